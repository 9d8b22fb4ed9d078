"""Installing automodel-core + automodel-retrieval is enough: declared dependencies cover every import, no other
domain is needed, the plugin and its shipped examples are found."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys

import pytest
import tomllib
from retrieval_testing import DIST_DIR, PKG_DIR

from automodel.cli.main import main

OTHER_DOMAINS = ("automodel_llm", "automodel_vlm", "automodel_diffusion")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0])


def _imported_top_level_modules() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(path.relative_to(PKG_DIR).as_posix())
    return found


def test_declared_dependencies_cover_every_third_party_import():
    project = tomllib.loads((DIST_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    assert "automodel-core" in declared
    core = {_requirement_name(r) for r in md.requires("automodel-core") or [] if "extra ==" not in r}
    available = declared | core
    distributions = md.packages_distributions()
    imports = _imported_top_level_modules()
    assert {"torch", "transformers", "datasets", "automodel"} <= imports.keys()  # the scan does see imports
    missing = {}
    for module, files in imports.items():
        if module in sys.stdlib_module_names or module == "automodel_retrieval":
            continue
        assert module not in OTHER_DOMAINS, f"{module} imported by {files}: the retrieval domain must stand alone"
        owners = {_normalize(d) for d in distributions.get(module, [])}
        assert owners, f"'{module}' (imported by {files}) is not provided by any installed distribution"
        if not owners & available:
            missing[module] = (sorted(owners), files)
    assert not missing, f"imported but not declared in automodel-retrieval/pyproject.toml (nor by core): {missing}"


def test_entry_point_and_package_data():
    eps = [ep for ep in md.entry_points(group="automodel") if ep.name == "retrieval"]
    assert [ep.value for ep in eps] == ["automodel_retrieval.plugin"]
    project = tomllib.loads((DIST_DIR / "pyproject.toml").read_text(encoding="utf-8"))
    data = project["tool"]["setuptools"]["package-data"]["automodel_retrieval"]
    assert "examples/*.yaml" in data and "examples/assets/**/*" in data
    for name in ("tiny_bi_encoder", "tiny_cross_encoder", "tiny_mine"):
        assert (PKG_DIR / "examples" / f"{name}.yaml").is_file()
    for asset in ("tiny_bert/config.json", "tiny_tokenizer/tokenizer.json", "tiny_tokenizer/tokenizer_config.json",
                  "tiny_retrieval/train.jsonl", "tiny_retrieval/validation.jsonl", "tiny_retrieval/corpus.jsonl"):
        assert (PKG_DIR / "examples" / "assets" / asset).is_file(), asset


def test_routes_aliases_and_examples(capsys):
    from automodel.cli.examples import list_examples
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    routes = {(r.command, r.domain): r.recipe for r in manager.routes.routes.values() if r.source ==
              "automodel-retrieval"}
    assert routes == {("finetune", "retrieval"): "automodel_retrieval.recipe.BiEncoderRecipe",
                      ("finetune", "cross-encoder"): "automodel_retrieval.recipe.CrossEncoderRecipe",
                      ("mine", "retrieval"): "automodel_retrieval.mining.MineHardNegativesRecipe",
                      ("kd", "retrieval"): "automodel_retrieval.distill.EmbeddingDistillRecipe"}
    assert manager.aliases.domains["bi-encoder"] == "retrieval"
    examples = list_examples(manager)
    assert {"retrieval/tiny_bi_encoder", "retrieval/tiny_cross_encoder", "retrieval/tiny_mine",
            "retrieval/tiny_distill"} <= examples.keys()
    for command, example in (("finetune bi-encoder", "tiny_bi_encoder"), ("finetune cross-encoder",
                                                                          "tiny_cross_encoder"),
                             ("mine retrieval", "tiny_mine"), ("kd retrieval", "tiny_distill")):
        assert main([*command.split(), "-c", f"retrieval/{example}", "--dry-run"]) == 0, command
    assert "dry run: nothing was built" in capsys.readouterr().out


@pytest.mark.smoke
def test_core_and_retrieval_alone_train_from_the_cli(tmp_path):
    """In a fresh interpreter where the other domain packages cannot be imported at all: the plugin loads, and
    `automodel finetune bi-encoder` trains two steps and writes a checkpoint."""
    script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {OTHER_DOMAINS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Block())
from automodel.cli.main import main
from automodel.plugins.manager import get_plugin_manager
info = get_plugin_manager().plugins["retrieval"]
assert info.ok, info
code = main(["finetune", "bi-encoder", "-c", "retrieval/tiny_bi_encoder", "--step_scheduler.max_steps", "2",
             "--step_scheduler.val_check_interval", "2", "--dataloader.batch_size", "4",
             "--checkpoint.checkpoint_dir", {str(tmp_path / 'ckpt')!r}])
assert not [m for m in sys.modules if m.split('.')[0] in {OTHER_DOMAINS!r}]
sys.exit(code)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "LATEST").is_file()
    assert "validation [validation] step 2" in result.stderr


def test_plugin_module_imports_no_torch():
    code = ("import sys, automodel_retrieval.plugin, automodel_retrieval; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
