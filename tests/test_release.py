"""What each distribution carries onto a package index: license, project URLs, a README that stands alone, a
changelog, one version written once, and compatible-release pins between the automodel distributions."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
DISTS = ("automodel-core", "automodel-llm", "automodel-vlm", "automodel-diffusion", "automodel-retrieval")
DOMAINS = DISTS[1:]
REPOSITORY = "https://github.com/automodel/automodel"
CORE_COMMANDS = {"cp", "validate", "recipes", "plugins", "new", "plot", "run", "export"}
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
MARKDOWN_LINK = re.compile(r"\]\(([^)]+)\)")


def project(dist: str) -> dict:
    return tomllib.loads((ROOT / dist / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_the_license_is_the_full_apache_2_text_and_every_distribution_declares_and_ships_it():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    for dist in DISTS:
        meta = project(dist)
        assert meta["license"] == "Apache-2.0", dist
        assert meta["license-files"] == ["LICENSE"], dist
        assert (ROOT / dist / "LICENSE").read_text(encoding="utf-8") == text, f"{dist}/LICENSE is not the root one"
        assert "include CHANGELOG.md" in (ROOT / dist / "MANIFEST.in").read_text(), f"{dist}: sdist lacks the changelog"


@pytest.mark.parametrize("dist", DISTS)
def test_project_urls_point_at_the_repository_and_the_distributions_own_changelog(dist):
    urls = project(dist)["urls"]
    assert urls["Homepage"] == urls["Repository"] == REPOSITORY
    assert urls["Documentation"] == f"{REPOSITORY}/tree/main/docs"
    assert urls["Issues"] == f"{REPOSITORY}/issues"
    assert urls["Changelog"] == f"{REPOSITORY}/blob/main/{dist}/CHANGELOG.md"
    assert (ROOT / dist / "CHANGELOG.md").is_file()


@pytest.mark.parametrize("dist", DISTS)
def test_changelog_has_an_unreleased_section_and_an_entry_for_the_current_version(dist):
    text = (ROOT / dist / "CHANGELOG.md").read_text(encoding="utf-8")
    version = project(dist)["version"]
    assert text.startswith(f"# Changelog: {dist}\n")
    assert "[Keep a Changelog](https://keepachangelog.com/" in text
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert headings[0] == ("Unreleased", ""), headings
    released = [name for name, date in headings[1:] if date]
    assert released and released[0] == version, f"the newest released entry is {released[:1]}, pyproject {version}"
    assert [Version(v) for v in released] == sorted((Version(v) for v in released), reverse=True)


@pytest.mark.parametrize("dist", DISTS)
def test_readme_stands_alone_on_a_package_index(dist):
    """Relative links and local paths break on an index page: every link is absolute, install is shown, the docs
    and the license are named."""
    text = (ROOT / dist / "README.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {dist}\n")
    assert f"pip install {dist}" in text
    for target in MARKDOWN_LINK.findall(text):
        assert target.startswith("https://"), f"{dist}/README.md links {target!r}: not absolute"
    assert f"{REPOSITORY}/tree/main/docs" in text and f"{REPOSITORY}/blob/main/{dist}/CHANGELOG.md" in text
    assert "## License" in text and "Apache-2.0" in text
    assert not re.search(r"(?<![\w.])/(work|tmp|home|root)/", text), f"{dist}/README.md names a local path"


def readme_commands(dist: str) -> list[list[str]]:
    """The `automodel ...` lines of the README's code blocks, comments dropped, in order."""
    found = []
    for block in FENCE.findall((ROOT / dist / "README.md").read_text(encoding="utf-8")):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["automodel"]:
                found.append(words[1:])
    return found


@pytest.mark.parametrize("dist", DISTS)
def test_readme_commands_run_against_the_installed_examples(dist, tmp_path, monkeypatch):
    """Each README's commands, in order, in a fresh directory: core commands run, training commands are
    validated and planned (--dry-run), so the examples they name exist and their overrides are accepted."""
    from automodel.cli.main import main
    from automodel.plugins.manager import reset_plugin_manager

    commands = readme_commands(dist)
    assert any("-c" in argv for argv in commands), f"{dist}/README.md shows no command with a shipped example"
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        if argv[0] not in CORE_COMMANDS:
            argv = [*argv, "--dry-run"]
        reset_plugin_manager(None)
        assert main(argv) == 0, f"{dist}/README.md: automodel {shlex.join(argv)}"
    reset_plugin_manager(None)


@pytest.mark.parametrize("dist", DISTS)
def test_the_version_is_written_once_in_pyproject_and_reported_from_the_installed_metadata(dist):
    version = project(dist)["version"]
    assert metadata.version(dist) == version, f"{dist} is installed as {metadata.version(dist)}: run make install"
    module = {"automodel-core": "automodel", "automodel-retrieval": "automodel_retrieval"}.get(dist)
    for path in (ROOT / dist / "src").rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            written = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            assert not written, f"{path.relative_to(ROOT)} writes the version again; read it from the metadata"
    if module is not None:
        assert __import__(module).__version__ == version


def test_cli_version_and_plugins_report_each_distributions_version():
    import json

    automodel = [sys.executable, "-m", "automodel.cli.main"]
    shown = subprocess.run([*automodel, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert shown.strip() == f"automodel, version {project('automodel-core')['version']}"
    plugins = subprocess.run([*automodel, "plugins", "--json"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    reported = {p["distribution"]: p["version"] for p in json.loads(plugins)}
    assert reported == {dist: project(dist)["version"] for dist in DISTS}


@pytest.mark.parametrize("dist", DOMAINS)
def test_domains_pin_automodel_distributions_to_the_compatible_minor_release(dist):
    """0.x: a minor release may break, so `~=0.1.0` (>=0.1.0, ==0.1.*) and not `~=0.1` (which admits 0.2)."""
    pins = [Requirement(r) for r in project(dist)["dependencies"] if r.startswith("automodel-")]
    assert [p.name for p in pins if p.name == "automodel-core"] == ["automodel-core"], dist
    for pin in pins:
        assert pin.name != dist
        target = Version(project(pin.name)["version"])
        (spec,) = pin.specifier
        assert spec.operator == "~=" and len(Version(spec.version).release) == 3, f"{dist}: {pin}"
        assert Version(spec.version).release[:2] == target.release[:2], f"{dist}: {pin} vs {pin.name} {target}"
        assert pin.specifier.contains(target), f"{dist}: {pin} excludes {pin.name} {target}"
        assert not pin.specifier.contains(f"{target.major}.{target.minor + 1}.0"), f"{dist}: {pin} admits a break"


def load_min_constraints():
    spec = importlib.util.spec_from_file_location("min_constraints", ROOT / "scripts" / "min_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_min_constraints_pin_every_floor_and_refuse_a_missing_or_split_one(tmp_path):
    script = load_min_constraints()
    floors = script.floors()
    assert floors["torch"][0] == "2.13" and set(floors["transformers"][1]) == set(DOMAINS)
    for dist in DISTS:
        for requirement in project(dist)["dependencies"]:
            name = script.normalize(Requirement(requirement).name)
            if not name.startswith("automodel-"):
                assert f">={floors[name][0]}" in str(Requirement(requirement).specifier), (dist, requirement)
    for dist in DISTS:
        (tmp_path / dist).mkdir()
        (tmp_path / dist / "pyproject.toml").write_text(
            f'[project]\nname = "{dist}"\ndependencies = ["numpy>=2.0", "click"]\n')
    (tmp_path / "automodel-llm" / "pyproject.toml").write_text('[project]\ndependencies = ["numpy>=1.26"]\n')
    with pytest.raises(ValueError) as err:
        script.floors(tmp_path)
    assert "'click' has no '>=' floor" in str(err.value) and "numpy: floors differ" in str(err.value)


def test_installation_doc_lists_every_floor_as_declared():
    documented = dict(re.findall(r"^\| (\S+) \| ([0-9][^ |]*) \|", (ROOT / "docs" / "installation.md").read_text(),
                                 re.M))
    floors = {name: floor for name, (floor, _) in load_min_constraints().floors().items()}
    assert {name.lower(): floor for name, floor in documented.items()} == floors
