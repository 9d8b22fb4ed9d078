"""The code's structure: data flows one way (the training engine never imports the CLI, the core never imports a
domain, no domain imports another, plugin modules import no torch), no core module grows past 400 lines, and
the product source (tests included) holds no duplicated run of 12 or more lines."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "automodel-core" / "src" / "automodel"
DOMAINS = {"automodel_llm": ROOT / "automodel-llm" / "src" / "automodel_llm",
           "automodel_vlm": ROOT / "automodel-vlm" / "src" / "automodel_vlm",
           "automodel_diffusion": ROOT / "automodel-diffusion" / "src" / "automodel_diffusion",
           "automodel_retrieval": ROOT / "automodel-retrieval" / "src" / "automodel_retrieval"}
MAX_CORE_LINES = 400


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in the file names (function-level imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in files:
        bad = sorted(n for n in imported_modules(path) if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_training_engine_never_imports_the_cli():
    assert offenders(sorted((CORE / "training").rglob("*.py")), ("automodel.cli",)) == {}


def test_the_core_never_imports_a_domain():
    assert offenders(sorted(CORE.rglob("*.py")), tuple(DOMAINS)) == {}


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_no_domain_imports_another(domain):
    others = tuple(d for d in DOMAINS if d != domain)
    assert offenders(sorted(DOMAINS[domain].rglob("*.py")), others) == {}


def test_plugin_modules_import_no_torch():
    modules = ["automodel", "automodel.plugins.manager", "automodel.builtin_plugin",
               *(f"{d}.plugin" for d in DOMAINS)]
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'diffusers', 'peft') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [], f"importing the plugin modules imported {result.stdout.strip()}"
    for path in [*sorted((CORE / "plugins").glob("*.py")), CORE / "builtin_plugin.py",
                 *(d / "plugin.py" for d in DOMAINS.values())]:
        assert not {n for n in imported_modules(path) if n.split(".")[0] == "torch"}, path


def test_validating_a_config_imports_neither_torch_pipelining_nor_the_compiler(tmp_path):
    """`automodel validate` (and the launcher, which validates before starting the ranks) reads the pipeline plan
    without torch's pipelining, which imports the compiler (dynamo): half a second of every such command."""
    code = ("import json, sys\nfrom automodel.cli.main import main\ncode = main(['validate', '-c', 'llm/tiny_squad'])\n"
            "print(json.dumps([code, sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo') "
            "if m in sys.modules)]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, []]


def test_no_core_module_is_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in CORE.rglob("*.py")}
    assert len(sizes) > 40, "the core's modules were not found"
    assert {p: n for p, n in sizes.items() if n > MAX_CORE_LINES} == {}


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the `duplicates` command is not installed here")
def test_no_duplicated_runs_of_12_lines():
    result = subprocess.run(["duplicates", "--min-lines", "12", "--most", "20", "--seconds", "300", "--repo",
                             str(ROOT)], capture_output=True, text=True, timeout=600, check=False)
    lines = result.stdout.splitlines()
    assert lines and lines[0].startswith("no duplicates"), result.stdout
    assert not any(line.startswith("incomplete") for line in lines), result.stdout
