"""What validation costs to import: every recipe module loads for `automodel validate` and for the launcher's check
before it starts the ranks, so those modules keep torch's sharding modules out until a model is sharded."""

from __future__ import annotations

VALIDATION_IMPORTS = """
import sys
import automodel_diffusion.recipe, automodel_llm.recipe, automodel_retrieval.recipe, automodel_vlm.recipe
print(sorted(m for m in sys.modules if m.split(".")[:3] in (["torch", "distributed", "tensor"],
                                                            ["torch", "distributed", "fsdp"],
                                                            ["torch", "distributed", "pipelining"])))
"""


def test_the_recipes_import_without_the_sharding_modules_of_torch(cli):
    """What validation imports (every recipe module, for `automodel validate` and the launcher's check before it
    starts the ranks) leaves out DTensor, FSDP and pipelining, about a second of imports per process: they load
    where a model is sharded."""
    result = cli.python(VALIDATION_IMPORTS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
