"""Fresh virtualenvs for the install tests (test_wheels.py, test_scaffold.py), offline.

A fresh virtualenv reuses this interpreter's third-party packages (torch cannot be downloaded here) through a
``.pth`` file naming a directory of links to them, less the automodel distributions, their editable-install hooks
and whatever else a test hides (pip, pytest): pip then has to install those, as it would for a user.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a reused site-packages never shows a fresh environment.
AUTOMODEL_FILES = ("automodel", "__editable__", "__pycache__")
PIP = ("pip",)
PYTEST = ("pytest", "_pytest", "py.py")


def run(argv: list, cwd: Path, timeout: float = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """``argv`` in a clean environment (no virtualenv, pip settings or AUTOMODEL_* of the caller), offline."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("PIP_", "AUTOMODEL_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1", **env_extra)
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
    return result


def third_party_links(dest: Path, hidden: tuple[str, ...]) -> Path:
    """A directory of links to this interpreter's site-packages entries, less those starting with ``hidden``."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        if entry.name.startswith(hidden) or entry.suffix == ".pth":
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def fresh_venv(root: Path, third_party_site: Path) -> Path:
    """A virtualenv without pip of its own whose ``.pth`` shows ``third_party_site``; returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root.parent)
    python = root / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout
    (Path(purelib.strip()) / "third_party_site.pth").write_text(f"{third_party_site}\n")
    return python


def repack_wheel(name: str, out: Path) -> Path:
    """A wheel of the installed distribution ``name`` from its installed files (what an offline index would hold):
    its package files and .dist-info; console scripts are left to pip, which writes them from entry_points.txt."""
    dist = metadata.distribution(name)
    version = dist.version
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{version}"
    wheel = out / f"{stem}-py3-none-any.whl"
    out.mkdir(parents=True, exist_ok=True)
    base = Path(dist.locate_file(""))
    skip = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
    files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in f.parts
             and f.name not in skip]
    with zipfile.ZipFile(wheel, "w") as archive:
        for file in files:
            archive.write(base / file, str(file))
        record = [f"{file},," for file in files] + [f"{stem}.dist-info/RECORD,,"]
        archive.writestr(f"{stem}.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel
