"""Issue 20 item 2: no silently ignored key. Every key of every keyed section of every installed recipe acts (code
reads it after validation: in the run, the launch or the slurm script) or is refused at validation with a reason.

The keys are not listed here: they are the sections' dataclass fields, and automodel.testing.key_effects finds
where each is read by running the product (the core's sections on the toy recipe; each domain's own sections on its
route's shipped example, made small) and validates the ones nothing read at non-default values. A key added with
neither an effect nor a refusal fails ``test_*_keys_act_or_are_refused``; ``test_a_key_with_no_effect_fails``
shows that it does.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from automodel.cli.examples import find_example
from automodel.cli.execute import import_recipe
from automodel.config import FieldErrors, build_config, load_yaml_file
from automodel.plugins.manager import get_plugin_manager
from automodel.testing import deep_update
from automodel.testing.key_effects import key_effects, keyed_sections, launch_phase, run_phase, slurm_phase
from automodel.training.recipe import TrainRecipe

TINY_LLAMA = Path(importlib.util.find_spec("automodel_llm").submodule_search_locations[0]) / "examples" / "assets" \
    / "tiny_llama" / "config.json"
# The settings under which a section's keys matter (a section with `enabled` is otherwise switched on).
CONTEXTS = {
    "compile": {"enabled": True, "backend": "eager"},
    "clip_grad_norm": {"max_norm": 1.0},
    "freeze": {"patterns": ["blocks.0.*"]},
    "qat": {"enabled": True, "group_size": 8},
    "packed_sequence": {"enabled": True, "packed_sequence_size": 64},
    "eval_generation": {"enabled": True, "num_examples": 2},
    "sample_generation": {"enabled": True, "num_inference_steps": 1},
    "objective": {"timestep_sampling": "beta"},  # beta_alpha / beta_beta act with beta sampling only
    "moe_metrics": {"enabled": True, "mode": "detailed"},  # detailed_every_steps acts in detailed mode only
    "tool_call_eval": {"path": "${pkg:automodel_llm}/examples/assets/tiny_tool_calls/train.jsonl",
                       "max_eval_samples": 1, "max_new_tokens": 2},
}
# A route's own form of a section named in CONTEXTS (the VLM recipe packs with pack_size, without `enabled`; its
# example's samples have 30 or 31 tokens, so drop_long_samples leaves the 31s out)
ROUTE_CONTEXTS = {("finetune", "vlm"): {"packed_sequence": {"pack_size": 30, "drop_long_samples": True,
                                                            "balance_media_tokens": True}}}
# Non-default values to validate a key with where its type gives none (a mapping)
PROBES = {"flow_matching": {"adapter_kwargs": [{"setting": 1}]},
          "distributed": {"multimodal": [{"frozen_sharding": "per_layer"}]}}
# Each route's shipped example, made small: two steps on a few samples, validating and checkpointing once.
TWO_STEPS = {"step_scheduler": {"max_steps": 2, "val_check_interval": 2, "checkpoint_interval": 2}}
_FEW = {"dataset": {"limit_dataset_samples": 16}, "validation_dataset": {"limit_dataset_samples": 4},
        "dataloader": {"batch_size": 4}}
SMALL = {
    ("finetune", "llm"): {**_FEW, "eval_generation": {"num_examples": 2}},
    ("benchmark", "llm"): {"benchmark": {"num_samples": 32, "seq_length": 16, "warmup_steps": 1},
                           "dataloader": {"batch_size": 4}},
    ("finetune", "vlm"): {**_FEW, "eval_generation": {"num_examples": 2}},
    ("finetune", "diffusion"): {"dataset": {"limit_samples": 8}, "validation_dataset": {"limit_samples": 4},
                                "dataloader": {"batch_size": 4}, "sample_generation": {"num_inference_steps": 1},
                                "step_scheduler": {"log_interval": 1}},
    ("finetune", "retrieval"): _FEW,
    ("finetune", "cross-encoder"): _FEW,
    ("finetune", "seq-cls"): {"dataset": {"num_samples_limit": 16}, "validation_dataset": {"num_samples_limit": 4},
                              "dataloader": {"batch_size": 4}},
    ("mine", "retrieval"): {"mining": {"limit": 8}},
    ("generate", "diffusion"): {"inference": {"num_inference_steps": 1}},
    ("precompute", "diffusion"): {"dataset": {"limit_samples": 4}, "output": {"shard_size": 2}},
}
# Sections that stand in place of others the route's example writes (upstream's fsdp: / ddp: for parallel_scheme,
# flow_matching: for objective, freeze_config: for freeze; validation refuses both at once): each is checked on the
# example changed as given, the route's other sections on the example as it is.
IN_PLACE_OF = {
    ("finetune", "diffusion"): [
        ({"parallel_scheme": None, "objective": None, "fsdp": {}, "flow_matching": {}}, ["fsdp", "flow_matching"]),
        ({"parallel_scheme": None, "ddp": {}}, ["ddp"]),
    ],
    ("finetune", "vlm"): [({"freeze": None, "freeze_config": {}}, ["freeze_config"])],
    # moe_metrics acts on a mixture-of-experts model: the example's tiny Llama as a 4-expert Qwen3-MoE
    ("finetune", "llm"): [({"model": {"config": {
        "model_type": "qwen3_moe", "vocab_size": json.loads(TINY_LLAMA.read_text())["vocab_size"], "hidden_size": 32,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}}},
        ["moe_metrics"])],
}
# Routes whose runs need another route's output first (mining reads a trained bi-encoder).
NEEDS = {("mine", "retrieval"): ("finetune", "retrieval")}


def _failures(effects) -> dict[str, str]:
    return {e.dotted: "neither read after validation nor refused at validation" for e in effects if not e.ok}


def _validator(recipe):
    resolver = get_plugin_manager().resolver()
    return lambda data: build_config(data, recipe, resolver)


@pytest.fixture(scope="module")
def core_effects(tmp_path_factory):
    from automodel.testing import ToyRecipe, toy_config

    cwd = tmp_path_factory.mktemp("core")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        base = toy_config(cwd / "ckpt", step_scheduler={"max_steps": 2}, dataset={"size": 16})
        sections = list(keyed_sections(ToyRecipe))
        return key_effects(ToyRecipe, base, sections, _validator(ToyRecipe),
                           [run_phase(ToyRecipe), launch_phase, slurm_phase], CONTEXTS, PROBES)


def test_core_sections_keys_act_or_are_refused(core_effects):
    assert {e.section for e in core_effects} == set(keyed_sections(TrainRecipe))
    assert _failures(core_effects) == {}


def _domain_sections(recipe) -> list[str]:
    core = set(keyed_sections(TrainRecipe).values())
    return [name for name, cls in keyed_sections(recipe).items() if cls not in core]


def _route_runs() -> dict[tuple[str, str], list[str]]:
    """The routes that run the domains' own sections, each with the sections it checks: every (section name, class)
    once, on a route that ships an example (`finetune` routes first: the others specialise their recipes)."""
    manager = get_plugin_manager()
    recipes = {key: import_recipe(route.recipe) for key, route in manager.routes.routes.items()}

    def specialises(key: tuple[str, str]) -> bool:  # a recipe subclassing another route's (after it: its own only)
        return any(other is not recipes[key] and issubclass(recipes[key], other) for other in recipes.values())

    chosen, covered = {}, set()
    for key, route in sorted(manager.routes.routes.items(),
                             key=lambda item: (item[0][0] != "finetune", specialises(item[0]), item[0])):
        recipe = import_recipe(route.recipe)
        if not route.examples:
            continue
        sections = [name for name in _domain_sections(recipe) if (name, keyed_sections(recipe)[name]) not in covered]
        if sections:
            chosen[key] = sections
            covered |= {(name, keyed_sections(recipe)[name]) for name in sections}
    return chosen


def test_every_domain_section_is_run_by_some_route():
    """A recipe's own keyed section is checked on a route that ships an example: every one of them is."""
    manager = get_plugin_manager()
    covered = {(name, keyed_sections(import_recipe(manager.routes.get(*key).recipe))[name])
               for key, sections in _route_runs().items() for name in sections}
    missing = [f"{c} {d}: {name}" for (c, d), route in manager.routes.routes.items()
               for name, cls in keyed_sections(import_recipe(route.recipe)).items()
               if name in _domain_sections(import_recipe(route.recipe)) and (name, cls) not in covered]
    assert missing == [], "ship an example for these routes (routes.add(..., examples=[...]))"


@pytest.fixture(scope="module")
def domain_cwd(tmp_path_factory):
    return tmp_path_factory.mktemp("domains")


@pytest.mark.parametrize("route", sorted(_route_runs(), key=lambda r: r in NEEDS), ids=" ".join)
def test_domain_sections_keys_act_or_are_refused(route, domain_cwd, monkeypatch):
    manager = get_plugin_manager()
    monkeypatch.chdir(domain_cwd)
    if route in NEEDS and not (domain_cwd / "runs").exists():
        pytest.skip(f"needs the run of {' '.join(NEEDS[route])} first (run the whole module)")
    found = manager.routes.get(*route)
    recipe = import_recipe(found.recipe)
    base = load_yaml_file(find_example(found.examples[0], manager))
    steps = TWO_STEPS if "step_scheduler" in recipe.all_sections() else {}
    base = deep_update(deep_update(base, steps), SMALL.get(route, {}))
    sections = _route_runs()[route]
    variants = [(overrides, [n for n in names if n in sections]) for overrides, names in IN_PLACE_OF.get(route, [])]
    moved = {name for _, names in variants for name in names}
    phases = [run_phase(recipe), launch_phase, slurm_phase]
    contexts = {**CONTEXTS, **ROUTE_CONTEXTS.get(route, {})}
    effects = key_effects(recipe, base, [n for n in sections if n not in moved], _validator(recipe), phases, contexts,
                          PROBES)
    for overrides, names in variants:
        effects += key_effects(recipe, deep_update(base, overrides), names, _validator(recipe), phases, contexts,
                               PROBES)
    assert effects, f"{' '.join(route)} has no section of its own to check"
    assert _failures(effects) == {}


# ---- the meta-test can fail -----------------------------------------------------------------------------------

@dataclass
class _Extra:
    used: int = field(default=1, metadata={"help": "read by the recipe"})
    unused: int = field(default=1, metadata={"help": "read by nothing"})
    refused: int = field(default=1, metadata={"help": "anything but 1 is refused"})

    def __post_init__(self) -> None:
        if self.refused != 1:
            raise FieldErrors({"refused": "cannot act here: the reason"})


def test_a_key_with_no_effect_fails(tmp_path, monkeypatch):
    from automodel.testing import ToyRecipe, toy_config

    class WithExtra(ToyRecipe):
        sections: ClassVar[dict] = {"extra": _Extra}

        def setup(self) -> None:
            super().setup()
            self.used = self.cfg.extra.used

    monkeypatch.chdir(tmp_path)
    base = toy_config(tmp_path / "ckpt", step_scheduler={"max_steps": 1}, dataset={"size": 8})
    effects = {e.key: e for e in key_effects(WithExtra, base, ["extra"], _validator(WithExtra),
                                              [run_phase(WithExtra)])}
    assert "test_key_effects" in effects["used"].read_by  # where: this file's WithExtra.setup
    assert effects["refused"].refused == "cannot act here: the reason"
    assert not effects["unused"].ok  # the failure the meta-test reports
