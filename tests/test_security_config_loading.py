"""Loading a config runs nothing and costs little (issue 21): `${pkg:NAME}` imports nothing and never finds the
working directory's files; the YAML loader refuses alias bombs, deep nesting and huge files with a clear message.

The CLI runs here as `python -m automodel.cli.main` (what every torchrun rank runs): the working directory is then
on sys.path, where a local `NAME/__init__.py` would be importable.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s

from automodel.testing import write_yaml

MEMORY_CAP = 3 * 1024**3  # a billion-laughs expansion would need far more


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _module_cli(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "automodel.cli.main", *map(str, args)], cwd=cwd,
                          env=h.cli_env(), capture_output=True, text=True, timeout=300, preexec_fn=_cap_memory)


def _config(cwd: Path, **sections) -> Path:
    config = h.run_config(h.write_tiny_llama(cwd / "model"), step_scheduler={"max_steps": 1})
    config.update(sections)
    return write_yaml(cwd / "cfg.yaml", config)


# ---- ${pkg:NAME} -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["evilpkg", "evilpkg.sub"])
def test_pkg_interpolation_imports_nothing_from_the_working_directory(tmp_path, name):
    s.write_evil_package(tmp_path)
    config = _config(tmp_path, checkpoint={"checkpoint_dir": f"${{pkg:{name}}}/x"}, ci={"path": f"${{pkg:{name}}}/x"})
    result = _module_cli(tmp_path, "validate", "finetune", "llm", "-c", config)
    assert result.returncode == 2, result.stderr
    assert (f"checkpoint.checkpoint_dir: ${{pkg:{name}}}: no installed distribution has a top-level package named "
            f"'{name}'") in result.stderr
    # ci: is metadata, never interpolated; an unknown package there is refused all the same
    assert f"ci.path: ${{pkg:{name}}}: no installed distribution has a top-level package named '{name}'" \
        in result.stderr
    assert not s.marker(tmp_path).exists()  # before: validate imported evilpkg/__init__.py


def test_a_local_directory_never_stands_in_for_an_installed_package(tmp_path):
    installed = Path(h.llm_assets()).parent.parent  # .../automodel_llm
    decoy = tmp_path / "automodel_llm"
    decoy.mkdir()
    (decoy / "__init__.py").write_text(f"open({str(s.marker(tmp_path))!r}, 'w').close()\n")
    # `python -c`: the working directory is first on sys.path, as under torchrun
    code = ("from automodel.config import interpolate\n"
            "print(interpolate({'p': '${pkg:automodel_llm}'}, [])['p'])\n")
    where = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=h.cli_env(), capture_output=True,
                           text=True, timeout=120)
    assert where.stdout.strip() == str(installed), where.stderr
    assert not s.marker(tmp_path).exists()


# ---- the YAML loader's caps ---------------------------------------------------------------------------------

def _billion_laughs() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i, name in enumerate("bcdefghij"):
        previous = "abcdefghij"[i]
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 10) + "]")
    lines.append("step_scheduler: {max_steps: 1}")
    return "\n".join(lines) + "\n" + "# padding to the red team's size\n" * 20


def test_billion_laughs_is_refused_without_expanding(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(_billion_laughs())
    assert 1000 < path.stat().st_size < 2500  # ~1.8 KB: 10^10 strings once expanded
    for argv in (["validate", "finetune", "llm"], ["finetune", "llm", "--dry-run"]):
        result = _module_cli(tmp_path, *argv, "-c", path)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "expands to more than 1,000,000 values" in result.stderr and "Traceback" not in result.stderr


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("ci: &loop\n  again: *loop\n")
    result = _module_cli(tmp_path, "validate", "finetune", "llm", "-c", path)
    assert result.returncode == 2 and "recursive alias" in result.stderr, result.stderr


@pytest.mark.parametrize("style", ["flow", "block"])
def test_deep_nesting_is_a_config_error_not_a_recursion_error(tmp_path, style):
    path = tmp_path / "deep.yaml"
    if style == "flow":
        path.write_text("ci: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    else:
        path.write_text("ci:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(400)) + " " * 401 + "b: 1\n")
    result = _module_cli(tmp_path, "validate", "finetune", "llm", "-c", path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "nests deeper than 100 levels" in result.stderr
    assert "RecursionError" not in result.stderr and "Traceback" not in result.stderr


def test_a_huge_config_is_refused_with_the_limit_named(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "w") as f:
        f.write("ci:\n  blob: ")
        f.write("x" * (50 * 1024 * 1024))
        f.write("\n")
    result = _module_cli(tmp_path, "validate", "finetune", "llm", "-c", path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "over the limit of 8,388,608 bytes (8 MiB)" in result.stderr and str(path) in result.stderr


def test_anchors_within_the_caps_still_work(tmp_path):
    from automodel.config import parse_yaml

    data = parse_yaml("base: &b {lr: 0.1, betas: [0.9, 0.95]}\noptimizer: *b\nother: {<<: *b, eps: 0.2}\n")
    assert data["optimizer"] == {"lr": 0.1, "betas": [0.9, 0.95]} and data["other"]["eps"] == 0.2
