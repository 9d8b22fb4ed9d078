"""FSDP2 through the real CLI on two CPU ranks (gloo): the shipped example finishes with its exact-match report,
two loopback "nodes" are one run, HSDP with LoRA, pretrained weights and activation checkpointing, and no rank
materialising the whole model while it loads (peak resident memory per rank), in bf16."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import llm_testing
import pytest
from llm_testing import DISTRIBUTED_OVERRIDES, TOKENIZER_DIR, losses

from automodel.testing import AUTOMODEL_BIN, cli_env, free_port, read_jsonl, run_cli, write_dist

TWO_RANKS = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2"]


def _run(*args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    result = run_cli(*args, cwd=cwd, timeout=timeout, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_llama_config) -> Path:
    """The tiny Llama (tied embeddings) saved as an HF checkpoint: what from_pretrained loads."""
    return llm_testing.save_pretrained_base(tmp_path_factory.mktemp("pretrained"), tiny_llama_config, seed=3,
                                            tokenizer=False)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_shipped_example_finishes_under_fsdp2_with_the_exact_match_report(tmp_path):
    """The generation after training runs a forward on every rank (FSDP2 gathers the weights in each one); with
    rank 0 alone it hung until the process group's timeout. The rendezvous port comes from dist_env."""
    port = free_port()
    result = _run("finetune", "llm", "-c", "llm/tiny_squad", *TWO_RANKS, "--step_scheduler.max_steps", "10",
                  "--checkpoint.checkpoint_dir", tmp_path / "run", "--dist_env.master_port", port, cwd=tmp_path,
                  timeout=900)
    assert f"--master-port={port}" in result.stderr  # dist_env.master_port acts when --master-port is absent
    assert "exact match on 100 validation questions" in result.stderr
    report = json.loads((tmp_path / "run" / "eval_generation.json").read_text())
    assert report["num_questions"] == 100 and report["step"] == 10
    assert "each rank materialises only its shards" in result.stderr


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_two_loopback_nodes_are_one_run(single_process, tmp_path):
    """`--nnodes 2 --node-rank 0|1 --nproc-per-node 1` on one machine: one run of two ranks, the losses of one
    process accumulating twice as much, each step logged once."""
    config, single = single_process
    port, out = free_port(), tmp_path / "run"
    node = [str(AUTOMODEL_BIN), "finetune", "llm", "-c", str(config), *DISTRIBUTED_OVERRIDES, "--distributed.strategy",
            "fsdp2", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "--checkpoint.checkpoint_dir", str(out)]
    nodes = [subprocess.Popen([*node, "--node-rank", str(rank)], cwd=tmp_path, env=cli_env(OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=600)[1] for proc in nodes]
    finally:
        for proc in nodes:
            proc.kill()
    for proc, stderr in zip(nodes, outputs, strict=True):
        assert proc.returncode == 0, stderr[-4000:]
        assert "launching 2 processes in all (--nproc-per-node 1 x --nnodes 2)" in stderr
    assert "FSDP2 over 2 ranks" in outputs[0]
    assert [row["step"] for row in read_jsonl(out / "training.jsonl")] == [1, 2, 3, 4]
    assert losses(out) == pytest.approx(losses(single / "ckpt"), abs=1e-5)


def test_hsdp_with_lora_pretrained_weights_and_activation_checkpointing(tiny_llama_config, pretrained, tmp_path):
    """Two replicas (HSDP's replicate dimension), LoRA on the meta-device model, tied embeddings read from the
    pretrained files, each block checkpointed: the losses of one plain process accumulating twice as much, and its
    end-of-run answers (peft's generate runs the inner model, outside the FSDP2 root's forward)."""
    config = llm_testing.write_config(tmp_path / "cfg.yaml", tiny_llama_config, tmp_path / "one", model={
        "_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
        "pretrained_model_name_or_path": str(pretrained), "config": None},
        peft={"dim": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        validation_dataset={**llm_testing.VALIDATION, "limit_dataset_samples": 4},
        eval_generation={"enabled": True, "num_shown": 4, "max_new_tokens": 4})
    one = _run("finetune", "llm", "-c", config, *DISTRIBUTED_OVERRIDES, "--step_scheduler.grad_accumulation_steps",
               "2", cwd=tmp_path)
    two = _run("finetune", "llm", "-c", config, *DISTRIBUTED_OVERRIDES, *TWO_RANKS, "--master-port", free_port(),
               "--distributed.dp_replicate_size", "2", "--distributed.activation_checkpointing", "true",
               "--checkpoint.checkpoint_dir", tmp_path / "two", cwd=tmp_path)
    assert "HSDP: 2 replicas x FSDP2 over 1 ranks" in two.stderr
    assert "activation checkpointing on 1 transformer blocks" in two.stderr
    assert f"tensors read from {pretrained}" in two.stderr
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    answers = [[line for line in log.splitlines() if "expected:" in line] for log in (one.stderr, two.stderr)]
    assert len(answers[0]) == 4 and answers[0] == answers[1]


# ---- memory: no rank holds the whole model while it loads -----------------------------------------------------

PROBE = '''
import ctypes
import gc
import json
import os
from pathlib import Path

from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction


def _status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class LoadMemoryProbe(FinetuneRecipeForNextTokenPrediction):
    """The fine-tuning recipe, measuring how far peak resident memory rises above the live size while the pipeline
    materialises (and shards) the model built on the meta device: the method of parallel_workers._peak_growth."""

    def after_model_built(self, ctx, model, meta):
        ctx = super().after_model_built(ctx, model, meta)
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: a large block is its own mapping, returned when freed
        libc.mallopt(-1, 65536)  # M_TRIM_THRESHOLD
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.rss_before = _status("VmRSS")
        return ctx

    def build_loss_fn(self, ctx):  # what setup builds right after the pipeline
        growth = _status("VmHWM") - self.rss_before
        Path(os.environ["PROBE_DIR"], f"rank{self.rank}.json").write_text(json.dumps({"load": growth}))
        return super().build_loss_fn(ctx)
'''

PROBE_PLUGIN = '''
from automodel import hookimpl


@hookimpl
def automodel_register_routes(routes):
    routes.add("probe", "llm", recipe="load_probe.recipe.LoadMemoryProbe", help="fine-tuning, measuring the load")
'''


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_no_rank_materialises_the_whole_model_while_loading_and_bf16_matches_one_process(tmp_path):
    """A 54 MB model (fp32, no tensor above 2% of it) from pretrained safetensors: one process's peak rises by at
    least the model while it loads; each of two FSDP2 ranks' by well under it (it reads only its slices). Both train
    in bf16 (one process: autocast; two ranks: FSDP2's MixedPrecisionPolicy, fp32 storage and reduction), and
    the two ranks' losses are those of the one process accumulating twice as much, to bf16's precision."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "base", max_shard_size=f"{model_bytes // 8 // 1000}KB")
    del model
    dist = write_dist(tmp_path / "dist", "load-probe", "0.1", {"probe": "load_probe.plugin"},
                      {"load_probe/__init__.py": "", "load_probe/recipe.py": PROBE,
                       "load_probe/plugin.py": PROBE_PLUGIN})
    yaml = llm_testing.write_config(tmp_path / "cfg.yaml", tmp_path / "base" / "config.json", tmp_path / "ckpt",
                                    model={"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                                           "pretrained_model_name_or_path": str(tmp_path / "base"), "config": None},
                                    tokenizer={"pretrained_model_name_or_path": str(TOKENIZER_DIR)},
                                    dist_env={"cpu_malloc_tuning": False}, checkpoint={"enabled": False},
                                    distributed={"mp_policy": {"param_dtype": "bf16", "reduce_dtype": "fp32"}})
    growth, output = {}, {}
    for name, extra in (("one", ["--step_scheduler.grad_accumulation_steps", "2"]),
                        ("two", [*TWO_RANKS, "--master-port", str(free_port())])):
        (tmp_path / name).mkdir()
        result = run_cli("probe", "llm", "-c", yaml, *DISTRIBUTED_OVERRIDES, "--step_scheduler.max_steps", "2",
                         "--checkpoint.checkpoint_dir", tmp_path / name, *extra, cwd=tmp_path, timeout=600,
                         PYTHONPATH=str(dist), PROBE_DIR=str(tmp_path / name), OMP_NUM_THREADS="1")
        assert result.returncode == 0, result.stderr[-4000:]
        growth[name] = [json.loads(p.read_text())["load"] for p in sorted((tmp_path / name).glob("rank*.json"))]
        output[name] = result.stderr
    assert model_bytes == pytest.approx(54e6, rel=0.02)
    assert growth["one"][0] >= model_bytes  # the measurement sees a whole copy where there is one
    assert len(growth["two"]) == 2
    for rank in growth["two"]:
        assert rank < 0.75 * model_bytes, (growth, model_bytes)
    assert "mixed precision (torch.autocast): params bf16 (stored fp32)" in output["one"]
    assert "mixed precision (FSDP2 MixedPrecisionPolicy): params bf16 (stored fp32), reduce fp32" in output["two"]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=2e-2)


def test_parameters_a_model_keeps_in_float32_get_fsdp2_units_of_their_own(tmp_path):
    """ERNIE 4.5 MoE keeps its router weight and score-correction bias in float32 in a bfloat16 model
    (transformers' ``_keep_in_fp32_modules_strict``); FSDP2 takes one dtype per unit, so a block holding both failed
    ("FSDP expects uniform original parameter dtype", upstream's ernie4_5_21b_a3b example). The routers become units
    of their own in float32; two ranks train with the losses of one process accumulating twice (bf16 precision)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    llama = json.loads(llm_testing.LLAMA_CONFIG.read_text())
    config = AutoConfig.for_model("ernie4_5_moe", vocab_size=llama["vocab_size"], hidden_size=32,
                                  intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4, moe_k=2,
                                  moe_layer_start_index=0, tie_word_embeddings=False,
                                  **{k: llama.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    model.save_pretrained(tmp_path / "base")
    yaml = llm_testing.write_config(tmp_path / "cfg.yaml", tmp_path / "base" / "config.json", tmp_path / "unused",
                                    model={"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                                           "pretrained_model_name_or_path": str(tmp_path / "base"), "config": None})
    steps = ["--step_scheduler.max_steps", "3", "--dataloader.batch_size", "2", "--dataloader.shuffle", "false"]
    llm_testing.run_finetune(yaml, tmp_path, tmp_path / "one", *steps, "--step_scheduler.grad_accumulation_steps", "2")
    log = llm_testing.run_finetune(yaml, tmp_path, tmp_path / "two", *steps, *TWO_RANKS)
    assert "4 modules the model keeps in float32 as units of their own" in log  # 2 routers and their biases
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
