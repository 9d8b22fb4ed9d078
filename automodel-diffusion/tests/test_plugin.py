"""The distribution plugs into the core through its entry point: routes, the shipped examples, a light import."""

from __future__ import annotations

import subprocess
import sys

from diffusion_testing import ASSETS, EXAMPLES, PKG_DIR


def test_routes_and_examples_are_registered():
    from automodel.cli.examples import list_examples
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    for command in ("finetune", "pretrain"):
        route = manager.routes.get(command, "diffusion")
        assert route is not None and route.recipe == "automodel_diffusion.recipe.DiffusionRecipe"
        assert route.source == "automodel-diffusion"
    examples = list_examples(manager)
    assert examples["diffusion/tiny_flow"] == EXAMPLES / "tiny_flow.yaml"
    assert examples["diffusion/tiny_unet"] == EXAMPLES / "tiny_unet.yaml"
    assert ("sharding", "diffusion") in manager.stages.stages


def test_plugin_import_is_light():
    code = ("import sys, automodel_diffusion.plugin, automodel_diffusion.parallel; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_shipped_assets_are_small_and_complete():
    total = sum(p.stat().st_size for p in PKG_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 2 * 1024 * 1024, f"the package is {total / 1024:.0f} KiB"
    for pipeline in ("tiny_flow", "tiny_unet"):
        assert (ASSETS / pipeline / "model_index.json").is_file()
        assert (ASSETS / pipeline / "tokenizer" / "tokenizer.json").is_file()
    assert len(list((ASSETS / "tiny_shapes" / "images").glob("*.png"))) == 352
