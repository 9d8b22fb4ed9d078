"""Installing one domain from the built wheels, as a user would from an index, brings the core and nothing else,
and its shipped example trains from a directory outside the repository.

The wheels are built from sdists (``python -m build``, as ``make dist`` does) into a wheelhouse holding the core
and every domain the tested ones could pull in (not diffusion, the slowest to build: were a tested domain to
depend on it, pip would fail for want of it just the same). The fresh virtualenv has no pip of its own (this
interpreter's pip drives it with ``--python``) and reuses this interpreter's third-party packages (torch cannot be
downloaded here) through a ``.pth`` file naming a directory of links to them, without the automodel
distributions, their editable-install hooks and pip. pip then resolves the domain offline (``--no-index``) against
the wheelhouse and those packages, so a dependency on another domain would be installed, and seen.
"""

from __future__ import annotations

import email
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
from venv_testing import AUTOMODEL_FILES, PIP, ROOT, fresh_venv, run, third_party_links

WHEELHOUSE = ("automodel-core", "automodel-llm", "automodel-vlm", "automodel-retrieval")

EXAMPLES = {
    "retrieval": ["finetune", "retrieval", "-c", "retrieval/tiny_bi_encoder", "--step_scheduler.max_steps", "2",
                  "--step_scheduler.val_check_interval", "2", "--dataloader.batch_size", "4",
                  "--checkpoint.checkpoint_dir", "ckpt"],
    "vlm": ["finetune", "vlm", "-c", "vlm/tiny_llava", "--step_scheduler.max_steps", "2",
            "--step_scheduler.val_check_interval", "2", "--dataloader.batch_size", "4",
            "--validation_dataset.limit_dataset_samples", "4", "--eval_generation.num_examples", "2",
            "--checkpoint.checkpoint_dir", "ckpt"],
}
# Where in a checkpoint the trained model lies, and the transformers class that loads it.
LOADERS = {"retrieval": ("model/query_encoder", "AutoModel"), "vlm": ("model", "AutoModelForImageTextToText")}


def project_version(dist: str) -> str:
    return tomllib.loads((ROOT / dist / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    for dist in WHEELHOUSE:
        run([sys.executable, "-m", "build", "--no-isolation", "--quiet", "--outdir", out, ROOT / dist], cwd=ROOT)
    assert len(list(out.glob("automodel_*.whl"))) == len(WHEELHOUSE)
    return out


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory) -> Path:
    """Links to this interpreter's site-packages entries, less automodel and the installer's own packages."""
    return third_party_links(tmp_path_factory.mktemp("third_party_site"), AUTOMODEL_FILES + PIP)


@pytest.mark.parametrize("dist", WHEELHOUSE)
def test_wheel_and_sdist_carry_the_license_urls_readme_and_changelog(dist, wheelhouse):
    stem = f"{dist.replace('-', '_')}-{project_version(dist)}"
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    with zipfile.ZipFile(wheelhouse / f"{stem}-py3-none-any.whl") as wheel:
        assert wheel.read(f"{stem}.dist-info/licenses/LICENSE").decode() == license_text
        meta = email.message_from_bytes(wheel.read(f"{stem}.dist-info/METADATA"))
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert {url.split(",")[0] for url in meta.get_all("Project-URL")} == \
        {"Homepage", "Documentation", "Repository", "Issues", "Changelog"}
    assert meta.get_payload() == (ROOT / dist / "README.md").read_text(encoding="utf-8")
    with tarfile.open(wheelhouse / f"{stem}.tar.gz") as sdist:
        for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"):
            member = sdist.getmember(f"{stem}/{name}")
            assert member.isfile(), f"{name} is not a regular file in the sdist"
        assert sdist.extractfile(f"{stem}/LICENSE").read().decode() == license_text


class AnotherDomainCameAlong(AssertionError):
    """Installing one domain installed another automodel distribution besides the core."""


def pip(python: Path) -> list:
    return [sys.executable, "-m", "pip", "--python", python]


def automodel_distributions(python: Path, cwd: Path) -> set[str]:
    listed = json.loads(run([*pip(python), "list", "--format", "json"], cwd=cwd).stdout)
    return {p["name"] for p in listed if p["name"].startswith("automodel")}


@pytest.mark.parametrize("domain", [pytest.param("retrieval", marks=pytest.mark.slow), "vlm"])
def test_one_domain_installs_alone_from_wheels_and_trains_outside_the_repository(
        domain, wheelhouse, third_party_site, tmp_path):
    dist = f"automodel-{domain}"
    python = fresh_venv(tmp_path / "venv", third_party_site)
    assert automodel_distributions(python, tmp_path) == set(), "automodel leaked into the fresh environment"
    run([*pip(python), "install", "--no-index", "--find-links", wheelhouse, dist], cwd=tmp_path)
    installed = automodel_distributions(python, tmp_path)
    assert {"automodel-core", dist} <= installed
    if installed != {"automodel-core", dist}:
        extra = sorted(installed - {"automodel-core", dist})
        raise AnotherDomainCameAlong(f"pip install {dist} also installed {extra}")

    work = tmp_path / "elsewhere"
    work.mkdir()
    automodel = tmp_path / "venv" / "bin" / "automodel"
    plugins = json.loads(run([automodel, "plugins", "--json"], cwd=work).stdout)
    assert {p["distribution"]: p["ok"] for p in plugins} == {"automodel-core": True, dist: True}
    where = run([python, "-c", f"import automodel, automodel_{domain}; print(automodel.__file__); "
                               f"print(automodel_{domain}.__file__)"], cwd=work).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path / "venv") for p in where), where

    result = run([automodel, *EXAMPLES[domain]], cwd=work, timeout=600)
    assert "validation [validation] step 2" in result.stderr
    latest = work / "ckpt" / (work / "ckpt" / "LATEST").read_text().strip()
    model_dir, loader = LOADERS[domain]
    run([python, "-c", f"import sys, transformers; transformers.{loader}.from_pretrained(sys.argv[1])",
         latest / model_dir], cwd=work)
