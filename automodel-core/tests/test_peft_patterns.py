"""peft.target_modules / exclude_modules as upstream writes them: module names and globs over the whole name."""

from __future__ import annotations

import pytest
from peft.tuners.tuners_utils import check_target_module_exists

from automodel.hf import PeftConfig

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj",
         "model.layers.0.mlp.up_proj", "model.layers.0.mlp.act", "lm_head"]


def _adapted(**kwargs) -> list[str]:
    config = PeftConfig(dim=4, **kwargs).to_lora_config()
    return [name for name in NAMES if check_target_module_exists(config, name)]


@pytest.mark.parametrize(("targets", "expected"), [
    ("*_proj", NAMES[:4]),  # upstream's string form: one glob
    (["*_proj"], NAMES[:4]),
    (["q_proj", "up_proj"], [NAMES[0], NAMES[3]]),  # plain names: any module so named
    (["*.layers.0.*.v_proj", "up_proj"], [NAMES[1], NAMES[3]]),  # a glob and a name together
    ("v_proj", NAMES[1:3]),
])
def test_target_modules_match_as_upstream(targets, expected):
    assert _adapted(target_modules=targets) == expected


def test_exclude_modules_globs_leave_modules_out():
    assert _adapted(target_modules="*_proj", exclude_modules=["*.layers.1.*"]) == [NAMES[0], NAMES[1], NAMES[3]]
