"""``distributed.enable_compile: true`` (upstream's per-layer compile) through the real recipe in one process: each
decoder layer of a Hugging Face Llama, wrapped for activation checkpointing, is compiled in place, and training
gives the losses of the same run without it. (aot_eager: dynamo's graphs and AOT autograd's forward / backward
split, without inductor's C++ build, which takes minutes on a shared CPU.)"""

from __future__ import annotations

import pytest
import torch
from llm_testing import losses, write_config, write_two_layer_llama_config

from automodel.testing import train_inprocess


def test_each_block_is_compiled_in_place_and_the_losses_stay(tmp_path):
    model_config = write_two_layer_llama_config(tmp_path)
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        config = write_config(tmp_path / f"{name}.yaml", model_config, tmp_path / name)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runs[name] = train_inprocess(config, "--step_scheduler.max_steps", "3", "--checkpoint.enabled", "false",
                                     "--distributed.activation_checkpointing", "true", "--compile.backend",
                                     "aot_eager", "--distributed.enable_compile", flag)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) is (flag == "true"), graphs  # the compiled forward ran (and only then)
    layers = runs["compiled"].model.model.layers
    assert len(layers) == 2
    for layer in layers:
        assert type(layer).__name__ == "CheckpointWrapper"  # compiled as it stands: the checkpoint inside
        assert layer._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is None for layer in runs["eager"].model.model.layers)
    assert runs["compiled"].model.state_dict().keys() == runs["eager"].model.state_dict().keys()  # no _orig_mod
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5, abs=1e-5)


def test_compile_attn_compiles_each_attention_module_in_place_and_the_losses_stay(tmp_path):
    """upstream's model.backend.compile_attn: each layer's self_attn as one graph (fullgraph), nothing else."""
    model_config = write_two_layer_llama_config(tmp_path)
    runs = {}
    for name, flag in (("eager", "false"), ("attn", "true")):
        config = write_config(tmp_path / f"{name}.yaml", model_config, tmp_path / name)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runs[name] = train_inprocess(config, "--step_scheduler.max_steps", "3", "--checkpoint.enabled", "false",
                                     "--compile.backend", "aot_eager", "--model.backend.compile_attn", flag)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) is (flag == "true"), graphs
    compiled = runs["attn"].model
    assert [layer.self_attn._compiled_call_impl is not None for layer in compiled.model.layers] == [True, True]
    assert all(layer._compiled_call_impl is None and layer.mlp._compiled_call_impl is None
               for layer in compiled.model.layers)
    assert compiled.state_dict().keys() == runs["eager"].model.state_dict().keys()
    assert losses(tmp_path / "attn") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5, abs=1e-5)


def test_compile_attn_is_one_way_of_compiling(tmp_path):
    from automodel.config import ConfigError
    from automodel.testing import load_config

    config = write_config(tmp_path / "cfg.yaml", write_two_layer_llama_config(tmp_path), tmp_path / "ckpt")
    with pytest.raises(ConfigError) as refused:
        load_config(config, "--model.backend.compile_attn", "true", "--compile.enabled", "true")
    assert ("model.backend.compile_attn: true compiles each block's attention module and compile.enabled: true the "
            "whole model; a model is compiled one way") in str(refused.value)
