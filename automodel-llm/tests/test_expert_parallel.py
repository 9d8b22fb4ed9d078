"""Expert parallelism through the CLI on CPU ranks (gloo): ``distributed.ep_size: 2`` on two ranks (dp 2, FSDP2)
trains a tiny Qwen3-MoE (4 experts, top-2, two MoE layers) with the per-step losses, gradient norms and validation
losses of one process accumulating twice; its consolidated ``model/`` is the one process's weights; its step-3
checkpoint resumes in one process with the uninterrupted run's losses, and the one process's under ep 2; dp 4 x ep 2
(two replicated groups), LoRA outside the experts and on them (with upstream's moe_rank_scaling) and upstream's moe
keys train like one process too; layouts the model cannot take are refused by ``automodel validate`` with the
numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_testing import (
    LLAMA_CONFIG,
    SIX_STEPS,
    VALIDATION,
    fsdp2_ranks_with,
    losses,
    val_losses,
    validate_cli,
    write_config,
    write_tiny_llama_config,
    write_tiny_moe_config,
)

from automodel.testing import free_port, read_jsonl, run_cli

EP2 = fsdp2_ranks_with("ep_size")


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("tiny_moe"))


def _run(config: Path, cwd: Path, directory: Path, *args) -> str:
    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli("finetune", "llm", "-c", config, *SIX_STEPS, *args, *port,
                     "--checkpoint.checkpoint_dir", directory, cwd=cwd, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, moe_config) -> tuple[Path, Path]:
    """(config, checkpoint_dir) of the one-process reference: two micro-batches per step (the two ranks' share),
    checkpoints after steps 3 and 6, validation after both."""
    tmp = tmp_path_factory.mktemp("one")
    config = write_config(tmp / "cfg.yaml", moe_config, tmp / "ckpt", validation_dataset=VALIDATION,
                          step_scheduler={"val_check_interval": 3})
    _run(config, tmp, tmp / "ckpt", "--step_scheduler.grad_accumulation_steps", "2")
    return config, tmp / "ckpt"


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory, one_process) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("ep2")
    return tmp / "ep", _run(one_process[0], tmp, tmp / "ep", *EP2)


def _norms(directory: Path) -> list[float]:
    return [row["grad_norm"] for row in read_jsonl(directory / "training.jsonl")]


def _assert_same_weights(model_dir: Path, reference_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).state_dict()
    assert model.keys() == reference.keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in model
    for key, value in reference.items():
        assert model[key].shape == value.shape, key
        assert (model[key] - value).abs().max().item() < 1e-5, key


def test_ep2_trains_like_one_process(one_process, ep2_run):
    _, reference = one_process
    out, log = ep2_run
    assert "expert parallel over ep 2" in log and "each rank holds 2 of 4 experts" in log
    assert "expert parameters (4) split by expert parallelism" in log
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert _norms(out) == pytest.approx(_norms(reference), rel=1e-4)
    assert max(_norms(reference)) > 1.0  # clipping at 1.0 acted: the norm spans the experts' shards too
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)], rel=1e-4)
    assert len(val_losses(out)) == 2
    _assert_same_weights(out / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_ep2_in_each_stage_of_pp2_on_four_ranks_trains_like_one_process(one_process, tmp_path):
    """pp 2 x dp 2 with ep 2: each stage's two data-parallel ranks split the experts of its MoE layer; two batches
    of one row per step with upstream's enable_fsdp_optimizations (gradients reduced after the second only, the
    parameters kept gathered in between), the one process's rows per step; its sharded checkpoint resumes there."""
    config, reference = one_process
    out = tmp_path / "pp_ep"
    log = _run(config, tmp_path, out, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.ep_size", "2", "--distributed.pp_size", "2",
               "--distributed.pipeline.pp_schedule", "gpipe",
               "--dataloader.batch_size", "1", "--step_scheduler.grad_accumulation_steps", "2",
               "--model.backend.enable_fsdp_optimizations", "true")
    assert "pipeline stage 0 of 2 on this rank (embedding + layers 0-0)" in log
    assert "of this pipeline stage): 1 experts modules, each rank holds 2 of 4 experts" in log
    assert losses(out) == pytest.approx(losses(reference), rel=1e-4)
    assert _norms(out) == pytest.approx(_norms(reference), rel=1e-4)
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(reference)], rel=1e-4)
    _assert_same_weights(out / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")
    one = tmp_path / "one"
    log = _run(config, tmp_path, one, "--restore_from.path", out / "epoch_0_step_3",
               "--step_scheduler.grad_accumulation_steps", "2")
    assert "written by 4 ranks, resuming on 1" in log
    assert losses(one) == pytest.approx(losses(reference)[3:], rel=1e-4)


def test_an_ep2_checkpoint_resumes_in_one_process(one_process, ep2_run, tmp_path):
    config, reference = one_process
    checkpoint = ep2_run[0] / "epoch_0_step_3"
    one = tmp_path / "one"
    log = _run(config, tmp_path, one, "--restore_from.path", checkpoint, "--step_scheduler.grad_accumulation_steps",
               "2")
    assert "written by 2 ranks, resuming on 1" in log
    assert [row["step"] for row in read_jsonl(one / "training.jsonl")] == [4, 5, 6]
    assert losses(one) == pytest.approx(losses(reference)[3:], rel=1e-4)
    _assert_same_weights(one / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_a_one_process_checkpoint_resumes_under_ep2(one_process, ep2_run, tmp_path):
    """Each rank reads its experts' slices of the one process's weights and optimizer state."""
    config, reference = one_process
    out = tmp_path / "ep"
    log = _run(config, tmp_path, out, *EP2, "--restore_from.path", reference / "epoch_0_step_3")
    assert "written by 1 ranks, resuming on 2" in log
    assert [row["step"] for row in read_jsonl(out / "training.jsonl")] == [4, 5, 6]
    assert losses(out) == pytest.approx(losses(ep2_run[0])[3:], rel=1e-4)
    _assert_same_weights(out / "epoch_0_step_6" / "model", reference / "epoch_0_step_6" / "model")


def test_layouts_the_model_cannot_take_are_refused_byvalidate_cli(moe_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt",
                          distributed={"strategy": "fsdp2", "ep_size": 3})
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "3", subprocess=True)
    assert code == 2 and "Traceback" not in out
    assert ("distributed.ep_size: 3 does not divide the number of experts (4, Qwen3MoeExperts "
            "'model.layers.0.mlp.experts')") in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.ep_size", "4")
    assert code == 2 and "distributed.ep_size: 4 does not divide the data-parallel x context-parallel ranks (2" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.ep_size", "2",
                          "--distributed.strategy", "ddp")
    assert code == 2 and "ddp: expert parallelism (ep_size 2) composes with FSDP2 only" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "4", "--distributed.ep_size", "2",
                          "--distributed.tp_size", "2")
    assert code == 2 and "is not combined with tensor parallelism here (tp_size 2)" in out
    tied = write_config(tmp_path / "tied.yaml", _tied(moe_config, tmp_path), tmp_path / "ckpt")
    code, out = validate_cli(tied, tmp_path, "--nproc-per-node", "2", "--distributed.strategy", "fsdp2",
                          "--distributed.ep_size", "2", "--distributed.moe.lm_head_precision", "float32")
    assert code == 2 and "distributed.moe.lm_head_precision: float32: the model ties its output head" in out
    code, out = validate_cli(tied, tmp_path, "--nproc-per-node", "2", "--distributed.strategy", "fsdp2",
                          "--distributed.ep_size", "2", "--distributed.moe.wrap_outer_model", "false")
    assert code == 2 and "distributed.moe.wrap_outer_model: false: the model ties its output head" in out
    code, out = validate_cli(config, tmp_path, "--nproc-per-node", "2", "--distributed.ep_size", "2",
                          "--distributed.moe.lm_head_precision", "float32", "--distributed.moe.wrap_outer_model",
                          "false")
    assert code == 0, out


def _tied(moe_config: Path, tmp_path: Path) -> Path:
    data = {**json.loads(moe_config.read_text()), "tie_word_embeddings": True}
    path = tmp_path / "tied" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def test_a_model_without_experts_is_refused_and_lora_on_the_experts_accepted(moe_config, tmp_path):
    dense = write_config(tmp_path / "dense.yaml", write_tiny_llama_config(tmp_path), tmp_path / "ckpt",
                         distributed={"strategy": "fsdp2", "ep_size": 2})
    code, out = validate_cli(dense, tmp_path, "--nproc-per-node", "2", subprocess=True)
    assert code == 2 and "Traceback" not in out
    assert ("distributed.ep_size: 2: expert parallelism splits the experts of a mixture-of-experts model, and "
            "LlamaForCausalLM has no experts module") in out
    moe = write_config(tmp_path / "moe.yaml", moe_config, tmp_path / "ckpt",
                       distributed={"strategy": "fsdp2", "ep_size": 2}, peft={"dim": 4})
    code, out = validate_cli(moe, tmp_path, "--nproc-per-node", "2", "--peft.moe_rank_scaling", "true")
    assert code == 0, out


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_lora_outside_the_experts_trains_like_one_process(one_process, tmp_path):
    """LoRA on the attention and the router: the frozen experts are split, the adapters FSDP2-sharded."""
    config = one_process[0]
    lora = ["--peft.dim", "4", "--peft.target_modules", "[q_proj, v_proj, gate]", "--step_scheduler.max_steps", "3"]
    one, ep = tmp_path / "one", tmp_path / "ep"
    _run(config, tmp_path, one, *lora, "--step_scheduler.grad_accumulation_steps", "2")
    log = _run(config, tmp_path, ep, *lora, *EP2)
    assert "LoRA r=4" in log and "expert parallel over ep 2" in log
    assert losses(ep) == pytest.approx(losses(one), rel=1e-4)
    assert _norms(ep) == pytest.approx(_norms(one), rel=1e-4)


def _adapter(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model" / "adapter_model.safetensors"))


def test_lora_on_the_experts_trains_like_one_process_and_resumes_there(one_process, moe_config, tmp_path):
    """All-linear LoRA (the experts' fused parameters adapted by peft's ParamWrapper) with upstream's
    moe_rank_scaling: the experts' rank is dim 4 // 2 experts per token; under ep 2 each rank adds its experts' slices
    of the factors. The ep 2 run's losses, gradient norms and adapter are the one process's, the adapter loads in
    peft, and its step-3 checkpoint resumes in one process."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = one_process[0]
    lora = ["--peft.dim", "4", "--peft.alpha", "8", "--peft.moe_rank_scaling", "true"]
    one, ep, resumed = tmp_path / "one", tmp_path / "ep", tmp_path / "resumed"
    _run(config, tmp_path, one, *lora, "--step_scheduler.grad_accumulation_steps", "2")
    log = _run(config, tmp_path, ep, *lora, *EP2)
    assert "LoRA r=4" in log and "expert parallel over ep 2" in log
    assert losses(ep) == pytest.approx(losses(one), rel=1e-4)
    assert _norms(ep) == pytest.approx(_norms(one), rel=1e-4)
    adapter, reference = _adapter(ep / "epoch_0_step_6"), _adapter(one / "epoch_0_step_6")
    assert adapter.keys() == reference.keys()
    experts = "base_model.model.model.layers.1.mlp.experts"
    assert adapter[f"{experts}.base_layer.lora_A.weight"].shape == (2 * 4, 32)  # rank 2 per expert, 4 experts
    assert adapter[f"{experts}.lora_B.weight"].shape == (32, 2 * 4)
    assert adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    for key, value in reference.items():
        assert (adapter[key] - value).abs().max().item() < 1e-5, key
    assert adapter[f"{experts}.lora_B.weight"].abs().max().item() > 0  # the experts' adapters trained
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_config.parent))
    loaded = PeftModel.from_pretrained(base, ep / "epoch_0_step_6" / "model").state_dict()
    assert torch.equal(loaded[f"{experts}.lora_B.default.weight"], adapter[f"{experts}.lora_B.weight"])
    log = _run(config, tmp_path, resumed, *lora, "--restore_from.path", ep / "epoch_0_step_3",
               "--step_scheduler.grad_accumulation_steps", "2")
    assert "written by 2 ranks, resuming on 1" in log
    assert losses(resumed) == pytest.approx(losses(one)[3:], rel=1e-4)


def test_the_expert_parallel_forward_adds_the_experts_lora_and_keeps_their_hooks(moe_config):
    """ep 1 in this process (gloo): with all-linear LoRA on the experts (nonzero factors), the replaced forward gives
    peft's loss and gradients of the experts' factors, and fake_balanced_gate's hook on the experts module still
    routes (the learned router would choose other experts)."""
    import torch
    import torch.distributed as dist

    from automodel.hf import PeftConfig, apply_lora
    from automodel.training.parallel.expert_parallel import apply_expert_parallel, build_expert_mesh
    from automodel_llm import AutoModelForCausalLM

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(str(moe_config), backend={"fake_balanced_gate": True})
        model, _ = apply_lora(base, PeftConfig(dim=4).to_lora_config(base))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
        models.append(model)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert len(apply_expert_parallel(models[1], build_expert_mesh(1, 1, "cpu"), 1)) == 2
        tokens = torch.randint(0, 400, (2, 8))
        results = []
        for model in models:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            results.append((loss.item(), {name: param.grad for name, param in model.named_parameters()
                                          if "experts" in name and param.grad is not None}))
    finally:
        dist.destroy_process_group()
    (loss, grads), (ep_loss, ep_grads) = results
    assert ep_loss == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == ep_grads.keys() and len(grads) == 8  # lora_A / lora_B of 2 parameters x 2 layers
    for name, grad in grads.items():
        assert torch.allclose(ep_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_moe_rank_scaling_needs_fused_experts_and_a_dim_of_the_experts_per_token_at_least(moe_config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.errors import AutomodelError
    from automodel.hf import PeftConfig

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_config.parent))
        dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA_CONFIG.parent))
    config = PeftConfig(dim=4, alpha=16, moe_rank_scaling=True).to_lora_config(moe)
    assert sorted(set(config.rank_pattern.values())) == [2] and len(config.rank_pattern) == 4  # 2 layers x 2
    assert set(config.alpha_pattern.values()) == {16}
    assert PeftConfig(dim=4).to_lora_config(moe).rank_pattern == {}
    with pytest.raises(AutomodelError, match=r"dim 1 // 2 experts per token = 0; set peft.dim to at least 2"):
        PeftConfig(dim=1, moe_rank_scaling=True).to_lora_config(moe)
    with pytest.raises(AutomodelError, match="this model has no fused experts"):
        PeftConfig(dim=4, moe_rank_scaling=True).to_lora_config(dense)


def test_upstreams_moe_keys_act_under_ep2_and_train_like_one_process(one_process, tmp_path):
    """Upstream's moe section with activation checkpointing: the routing kept through the recomputation, the head in
    fp32 (the run is fp32 on CPU, so the losses stay the one process's), no block resharded after forward, the inner
    model the FSDP2 root (with two micro-batches a step: every unit's gradient sync deferred to the last)."""
    config = one_process[0]
    three = ["--step_scheduler.max_steps", "3"]
    moe = ["--distributed.activation_checkpointing", "true", "--distributed.moe.ignore_router_for_ac", "true",
           "--distributed.moe.lm_head_precision", "float32", "--distributed.moe.reshard_after_forward", "false",
           "--distributed.moe.wrap_outer_model", "false"]
    one, ep = tmp_path / "one", tmp_path / "ep"
    _run(config, tmp_path, one, *three, "--step_scheduler.grad_accumulation_steps", "4")
    log = _run(config, tmp_path, ep, *three, *EP2, *moe, "--step_scheduler.grad_accumulation_steps", "2")
    assert "activation checkpointing on 2 transformer blocks (the routing top-k saved, not recomputed)" in log
    assert "blocks sharded, the output head in fp32, the inner model as root, the outer unsharded)" in log
    assert losses(ep) == pytest.approx(losses(one), rel=1e-4)
    assert _norms(ep) == pytest.approx(_norms(one), rel=1e-4)


@pytest.mark.slow
def test_gpt_oss_biased_transposed_experts_train_under_ep2_like_one_process(tmp_path):
    """GPT-OSS's experts (biases, weights stored [in, out], gate and up interleaved and clamped by its own gate):
    each rank computes its two of four experts as transformers' experts do; the losses, gradient norms and trained
    weights (the biases' too) are one process's."""
    llama = json.loads(LLAMA_CONFIG.read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "vocab_size": llama["vocab_size"], "bos_token_id": llama.get("bos_token_id"),
        "eos_token_id": llama.get("eos_token_id"), "hidden_size": 32, "intermediate_size": 16, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 16, "tie_word_embeddings": False}))
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "config.json", tmp_path / "unused")
    one, ep = tmp_path / "one", tmp_path / "ep"
    _run(config, tmp_path, one, "--step_scheduler.grad_accumulation_steps", "2")
    log = _run(config, tmp_path, ep, *EP2)
    assert "each rank holds 2 of 4 experts" in log
    assert losses(ep) == pytest.approx(losses(one), rel=1e-4)
    assert _norms(ep) == pytest.approx(_norms(one), rel=1e-4)
    from safetensors.torch import load_file

    trained, reference = (load_file(run / "epoch_0_step_6" / "model" / "model.safetensors") for run in (ep, one))
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in trained
    for key, value in reference.items():
        assert (trained[key] - value).abs().max().item() < 1e-5, key


def test_fake_balanced_gate_spreads_the_tokens_evenly_over_the_experts(moe_config):
    import torch

    from automodel.errors import AutomodelError
    from automodel_llm import AutoModelForCausalLM

    seen = []
    model = AutoModelForCausalLM.from_config(str(moe_config), backend={"fake_balanced_gate": True})
    for module in model.modules():
        if type(module).__name__ == "Qwen3MoeExperts":
            module.register_forward_hook(lambda m, args, out: seen.append((args[1].clone(), args[2].clone())))
    tokens = torch.randint(0, 400, (3, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert len(seen) == 2  # both MoE layers
    for index, weights in seen:
        assert index.shape == (24, 2)
        assert torch.bincount(index.flatten(), minlength=4).tolist() == [12, 12, 12, 12]
        assert (index[:, 0] != index[:, 1]).all()  # a token's two slots go to two experts
        assert torch.equal(weights, torch.full_like(weights, 0.5))
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().max().item() == 0.0
    learned = AutoModelForCausalLM.from_config(str(moe_config))
    learned.model.layers[0].mlp.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].clone()))
    learned(input_ids=tokens)
    assert not torch.equal(seen[-1], seen[0][0])  # without it the learned router chooses
    with pytest.raises(AutomodelError, match="LlamaForCausalLM has no experts module"):
        AutoModelForCausalLM.from_config(str(LLAMA_CONFIG), backend={"fake_balanced_gate": True})


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_two_ep_groups_on_four_ranks_train_like_one_process(one_process, tmp_path):
    """dp 4, ep 2: the groups (0, 1) and (2, 3) replicate the experts; their gradients are summed over the groups."""
    config, reference = one_process
    out = tmp_path / "ep"
    log = _run(config, tmp_path, out, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
               "--distributed.ep_size", "2", "--dataloader.batch_size", "1", "--step_scheduler.max_steps", "3")
    assert "expert parallel over ep 2 (2 groups of consecutive ranks)" in log
    assert losses(out) == pytest.approx(losses(reference)[:3], rel=1e-4)
    assert _norms(out) == pytest.approx(_norms(reference)[:3], rel=1e-4)
    _assert_same_weights(out / "epoch_0_step_3" / "model", reference / "epoch_0_step_3" / "model")


def test_dry_run_shows_the_expert_groups(moe_config, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", moe_config, tmp_path / "ckpt")
    result = run_cli("finetune", "llm", "-c", config, "--nproc-per-node", "4", "--distributed.strategy", "fsdp2",
                     "--distributed.ep_size", "2", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("expert parallel over ep 2: 2 group(s) of 2 consecutive data-parallel ranks, each rank holds 2 of 4 "
            "experts of every MoE layer (FSDP2 shards the rest over dp 4)") in result.stdout + result.stderr


@pytest.mark.parametrize(("model_type", "sizes"), [
    ("mixtral", {"num_local_experts": 4}),
    ("olmoe", {"num_experts": 4}),
    ("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}),
    ("deepseek_v3", {"n_routed_experts": 4, "moe_intermediate_size": 8, "first_k_dense_replace": 0, "n_group": 1,
                     "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 4, "v_head_dim": 8}),
    ("gpt_oss", {"num_local_experts": 4}),  # biased, transposed, gate and up interleaved
    ("nemotron_h", {"n_routed_experts": 4, "moe_intermediate_size": 8, "moe_shared_expert_intermediate_size": 8,
                    "layers_block_type": ["moe"], "n_groups": 1}),  # up_proj / down_proj: no gate
])
def test_which_experts_modules_expert_parallelism_takes(model_type, sizes):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.training.parallel.expert_parallel import experts_issues

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
                                  **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert [issue.message for issue in experts_issues(model, 2)] == []
    (message,) = [issue.message for issue in experts_issues(model, 3)]
    assert message.startswith("3 does not divide the number of experts (4, ")
