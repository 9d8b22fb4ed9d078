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


def _tiny(moe: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    sizes = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1}
    config = Qwen3MoeConfig(**sizes, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=8) \
        if moe else LlamaConfig(**sizes, intermediate_size=32)
    return AutoModelForCausalLM.from_config(config)


def _lora_ranks(model, config) -> dict[str, int]:
    import peft

    wrapped = peft.get_peft_model(model, config)
    return {name.removeprefix("base_model.model.").split(".lora_A")[0]: param.shape[0]
            for name, param in wrapped.named_parameters() if ".lora_A." in name}


def test_a_bare_star_adapts_every_linear_layer_and_the_experts_as_upstream():
    from automodel.errors import AutomodelError

    dense = _tiny(moe=False)
    ranks = _lora_ranks(dense, PeftConfig(dim=4, target_modules=["*"]).to_lora_config(dense))
    linear = [n for n, m in _tiny(moe=False).named_modules() if type(m).__name__ == "Linear"]
    assert sorted(ranks) == sorted(linear) and "lm_head" in ranks  # upstream's '*': the output head too
    moe = _tiny(moe=True)
    ranks = _lora_ranks(moe, PeftConfig(dim=4, target_modules="*", moe_rank_scaling=True).to_lora_config(moe))
    assert "model.layers.0.mlp.experts" in ranks and "model.layers.0.self_attn.q_proj" in ranks
    assert ranks["model.layers.0.self_attn.q_proj"] == 4
    # peft stacks the 4 experts' factors; each expert's rank is dim 4 // 2 experts per token, both fused weights
    assert ranks["model.layers.0.mlp.experts"] == ranks["model.layers.0.mlp.experts.base_layer"] == 4 * (4 // 2)
    with pytest.raises(AutomodelError, match="matches no linear layer or MoE experts module"):
        PeftConfig(dim=4, target_modules=["*.nothing"]).to_lora_config(dense)
    with pytest.raises(AutomodelError, match="reach none"):
        PeftConfig(dim=4, target_modules=["*_proj"], moe_rank_scaling=True).to_lora_config(_tiny(moe=True))


def test_dora_on_a_moe_model_is_refused_where_the_targets_reach_the_fused_experts():
    from automodel.errors import AutomodelError

    moe = _tiny(moe=True)
    for targets, reach in ((None, "all linear layers"), ("*", r"target_modules \*")):
        with pytest.raises(AutomodelError, match=f"peft.use_dora: true: peft's DoRA cannot adapt .* which {reach}"):
            PeftConfig(dim=4, target_modules=targets, use_dora=True).to_lora_config(moe)
    ranks = _lora_ranks(moe, PeftConfig(dim=4, target_modules=["q_proj"], use_dora=True).to_lora_config(moe))
    assert list(ranks) == ["model.layers.0.self_attn.q_proj"]
    dense = _tiny(moe=False)  # all-linear DoRA on a dense model: every projection
    assert len(_lora_ranks(dense, PeftConfig(dim=4, use_dora=True).to_lora_config(dense))) == 7


@pytest.fixture(scope="module")
def falcon_h1():
    """A tiny hybrid attention + Mamba model: peft refuses LoRA on its Mamba mixers' out_proj."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    config = FalconH1Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, mamba_d_ssm=32,
                            mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("targets", ["*_proj", None])  # upstream's Falcon-H1 LoRA glob; all linear layers
def test_globs_leave_out_the_mamba_out_proj_peft_refuses_and_say_so(falcon_h1, targets):
    import copy

    from automodel.hf import apply_lora, skipped_note

    built = PeftConfig(dim=4, target_modules=targets)
    wrapped, _ = apply_lora(copy.deepcopy(falcon_h1), built.to_lora_config(falcon_h1))
    adapted = {name.split(".lora_A.")[0] for name, _ in wrapped.named_parameters() if ".lora_A." in name}
    short = {name.rsplit(".", 1)[-1] for name in adapted}
    assert {"in_proj", "q_proj", "o_proj", "down_proj"} <= short and "out_proj" not in short
    assert built.skipped == [f"model.layers.{i}.mamba.out_proj" for i in range(2)]
    assert "leaves out out_proj (x 2)" in skipped_note(built)


def test_naming_the_mamba_out_proj_is_refused_with_the_names_to_use(falcon_h1):
    from automodel.errors import AutomodelError

    with pytest.raises(AutomodelError, match=r"\['out_proj'\] cannot take LoRA on a falcon_h1 .*\['q_proj'\]"):
        PeftConfig(dim=4, target_modules=["q_proj", "out_proj"]).to_lora_config(falcon_h1)
