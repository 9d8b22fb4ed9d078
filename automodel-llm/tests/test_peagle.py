"""P-EAGLE (``automodel finetune eagle3`` with ``eagle3.parallel_drafting: true``; upstream's ``TrainEagle3Recipe``
with ``recipe_args.parallel_drafting``): the draft drafts ``num_depths`` tokens in one forward, trained on
COD-sampled chains.

Against conftest's ``chat_target`` the draft must learn to draft every depth on held-out rows, be written in the
EAGLE-3 layout with P-EAGLE's additions (``layers.<i>``, ``mask_hidden``, the config keys) and load back, run from
upstream's ``recipe_args:`` form, and train on two ranks as one process (each row draws its chains from its own
generator). COD sampling, the visibility and the loss are checked by hand; the keys that cannot act are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llm_testing import (
    ASSETS,
    assert_refused,
    assert_resumes_and_exports,
    run_route,
    two_rank_records,
    write_draft_config,
)
from safetensors import safe_open

from automodel.testing import read_jsonl, run_cli, write_yaml
from automodel_llm.eagle3.draft import LlamaForCausalLMEagle3, draft_config
from automodel_llm.eagle3.parallel import cod_elements, parallel_sums, reference_positions, visibility

CHAT = ASSETS / "tiny_chat"
AUX = [0, 2, 3]  # of the 5-layer target
MASK = 3  # <unk> of the tiny tokenizer: the chat rows never use it
PEAGLE = {"parallel_drafting": True, "mask_token_id": MASK, "num_depths": 4, "num_draft_layers": 2,
          "draft_vocab_size": 64, "aux_layer_ids": AUX}


def peagle_config(path: Path, target: Path, checkpoint_dir: Path, **sections) -> Path:
    return write_draft_config(path, target, checkpoint_dir, {"eagle3": dict(PEAGLE)}, **sections)


@pytest.fixture(scope="module")
def trained(chat_target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("peagle")
    log = run_route("eagle3", peagle_config(root / "peagle.yaml", chat_target, root / "run"), root)
    assert "P-EAGLE: a 2-layer draft drafting 4 tokens in one forward" in log and "embeddings trained" in log
    return root / "run"


def test_a_peagle_draft_learns_to_draft_every_depth_of_held_out_rows(trained):
    records = read_jsonl(trained / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60]
    start, end = records[0], records[-1]
    assert start["accuracy"] < 0.1 and start["accept_length"] < 1.2  # an untrained draft: chance
    assert end["accuracy_depth0"] > 0.7 and end["accuracy_depth3"] > 0.25  # 0.81 and 0.37 when written
    assert end["accept_length"] > 2.4  # 2.71
    assert end["val_loss"] < start["val_loss"] / 3
    steps = read_jsonl(trained / "training.jsonl")
    assert {f"loss_depth{k}" for k in range(4)} <= set(steps[0])


def test_the_draft_is_written_as_eagle3s_with_p_eagles_layers_placeholder_and_keys(trained):
    model_dir = next(trained.glob("epoch_*_step_60")) / "model"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("mask_hidden").get_shape() == [1, 1, 3 * 128]  # the pre-fc width of the three states
    assert {"midlayer.hidden_norm.weight", "layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight",
            "mask_hidden", "fc.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith("layers.0.") or name.startswith("layers.2.") for name in names)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert {key: config[key] for key in ("parallel_drafting", "mask_token_id", "num_depths", "num_hidden_layers",
                                         "down_sample_ratio", "down_sample_ratio_min")} == {
        "parallel_drafting": True, "mask_token_id": MASK, "num_depths": 4, "num_hidden_layers": 2,
        "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2}
    draft = LlamaForCausalLMEagle3.from_pretrained(str(model_dir))
    assert list(draft.layers) == ["1"] and draft.mask_hidden.shape == (1, 1, 384)


def test_upstreams_recipe_args_form_runs(chat_target, tmp_path):
    """A project-written config in upstream's P-EAGLE form (recipe: TrainEagle3Recipe, recipe_args with the P-EAGLE
    knobs), run with `automodel run -c`."""
    out = tmp_path / "outputs"
    data = {
        "recipe": "TrainEagle3Recipe",
        "dist_env": {"backend": "nccl", "timeout_minutes": 5},
        "recipe_args": {
            "target_model_name_or_path": str(chat_target), "train_data_path": str(CHAT / "train.jsonl"),
            "val_data_path": None, "train_split": None, "val_split": None, "output_dir": str(out),
            "seq_length": 48, "micro_batch_size": 8, "grad_accumulation_steps": 1, "num_workers": 0,
            "num_epochs": 1, "draft_vocab_size": 64, "freeze_embeddings": True, "trust_remote_code": False,
            "shuffle_seed": 42, "log_every_steps": 1, "max_grad_norm": 1.0, "aux_layer_ids": AUX,
            "parallel_drafting": True, "num_depths": 3, "num_draft_layers": 3, "down_sample_ratio": 0.8,
            "down_sample_ratio_min": 0.3, "mask_token_id": MASK, "sequence_partitions": 1},
        "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0, "warmup_ratio": 0.015},
    }
    result = run_cli("run", "-c", write_yaml(tmp_path / "upstream_peagle.yaml", data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "P-EAGLE: a 3-layer draft drafting 3 tokens in one forward (COD ratio 0.8, floor 0.3" in result.stderr
    assert "embeddings frozen" in result.stderr
    records = read_jsonl(out / "checkpoints" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and all("loss_depth2" in r for r in records)
    config = json.loads((out / "checkpoints" / "epoch_0_step_6" / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_depths"], config["down_sample_ratio"]) == (3, 3, 0.8)


@pytest.mark.slow
def test_two_fsdp2_ranks_train_a_peagle_draft_as_one_process(chat_target, tmp_path):
    """make test-slow: each row draws its chains from its own generator, whichever rank reads it."""
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = peagle_config(tmp_path / "peagle.yaml", chat_target, tmp_path / "one", step_scheduler=steps,
                        dataset={"limit_dataset_samples": 32})
    run_route("eagle3", cfg, tmp_path, "--step_scheduler.grad_accumulation_steps", 2)
    one, two, val_one, val_two = two_rank_records("eagle3", cfg, tmp_path / "one", tmp_path, "fsdp2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    for key in ("val_loss", "accuracy", "accept_length", "accuracy_depth3"):
        assert val_two[key] == pytest.approx(val_one[key], rel=1e-4), key


@pytest.mark.slow
def test_a_resumed_peagle_run_trains_as_the_uninterrupted_one_and_exports_to_the_same_draft(chat_target, tmp_path):
    """make test-slow: the same chains are drawn after a resume; the export says how the draft is served."""
    steps = {"max_steps": 4, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = peagle_config(tmp_path / "peagle.yaml", chat_target, tmp_path / "whole", step_scheduler=steps,
                        validation_dataset=None, lr_scheduler={"warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    layers = {f"{layer}.{name}.weight" for layer in ("midlayer", "layers.1") for name in (
        "input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}_proj" for p in "qkvo"),
        *(f"mlp.{p}_proj" for p in ("gate", "up", "down")))}
    names = {*layers, "midlayer.hidden_norm.weight", "embed_tokens.weight", "fc.weight", "norm.weight",
             "lm_head.weight", "d2t", "t2d", "mask_hidden"}
    assert_resumes_and_exports("eagle3", cfg, tmp_path, names, "a P-EAGLE draft (LlamaForCausalLMEagle3)")


# ---- the pieces ----------------------------------------------------------------------------------------------

def test_cod_sampling_keeps_every_position_at_depth_zero_and_extends_whole_chains_deeper():
    valid = torch.zeros(40, dtype=torch.bool)
    valid[5:30] = True
    valid[33:38] = True
    anchors, depths = cod_elements(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(anchors[depths == 0], torch.arange(40))
    chains = set(zip(anchors.tolist(), depths.tolist(), strict=True))
    for anchor, depth in chains:
        if depth:
            assert (anchor, depth - 1) in chains and bool(valid[anchor + depth]) and anchor + depth > 0
    sizes = [int((depths == d).sum()) for d in range(5)]
    assert sizes[0] == 40 and sizes[1] == int((30 - 1) * 0.7)  # 30 counted positions
    assert sizes[1] >= sizes[2] >= sizes[3] >= sizes[4] > 0
    again = cod_elements(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], anchors) and torch.equal(again[1], depths)  # the generator decides


def test_an_element_sees_the_context_up_to_its_anchor_and_its_own_chain_up_to_its_depth():
    # upstream's example: a row of 6, chains at depth 1 from 0, 1, 3, 4; depth 2 from 0, 3; depth 3 from 0
    anchors = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0])
    depths = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    seen = visibility(anchors, depths)
    assert seen[11].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 11]  # (3, 2): context 0..3, its (3, 1)
    assert seen[12].nonzero().flatten().tolist() == [0, 6, 10, 12]  # (0, 3): its whole chain
    assert seen[:6, :6].equal(torch.ones(6, 6, dtype=torch.bool).tril())  # depth 0: causal


def _pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    parallel = {"num_hidden_layers": 2, "mask_token_id": 49, "num_depths": 3, "down_sample_ratio": 1.0,
                "down_sample_ratio_min": 1.0}
    draft = LlamaForCausalLMEagle3(draft_config(config, 50, AUX, "sdpa", False, False, parallel)).eval()
    draft.set_vocabulary(torch.arange(50))
    return target, draft


def test_the_loss_is_the_kl_from_the_targets_distribution_of_the_token_after_each_elements_position():
    target, draft = _pair()
    ids = torch.randint(0, 40, (1, 10))
    supervised = torch.ones(1, 10, dtype=torch.bool)
    valid = reference_positions(supervised[0], 10)
    assert valid.tolist() == [True] * 8 + [False]  # position p drafts the token at p + 2
    elements = cod_elements(valid, 3, 1.0, 1.0, torch.Generator().manual_seed(0))  # every chain, whole
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1] for i in AUX], dim=-1)
        sums = parallel_sums(draft, ids, supervised, aux, out.logits, [elements])
        anchors, depths = elements
        assert [int(c) for c in sums.counted] == [8, 7, 6]
        # element (2, 1): the mask token and the placeholder at position 3, seeing the context up to 2 and (2, 0)
        positions = torch.tensor([0, 1, 2, 3])
        tokens = torch.tensor([ids[0, 1], ids[0, 2], ids[0, 3], 49])
        placeholder = draft.fuse(draft.mask_hidden.view(1, -1))
        states = torch.cat([draft.fuse(aux[0, :3]), placeholder])
        seen = torch.ones(4, 4, dtype=torch.bool).tril()
        logits = draft.parallel(tokens[None], states[None], positions[None], seen[None, None])[0, 3]
        teacher = torch.log_softmax(out.logits[0, 4], -1)
        by_hand = (teacher.exp() * (teacher - torch.log_softmax(logits, -1))).sum()
        index = int(((anchors == 2) & (depths == 1)).nonzero())
        flat = draft.parallel(torch.where(depths == 0, ids[0, (anchors + depths + 1).clamp(max=9)], 49)[None],
                              torch.where((depths == 0)[:, None], draft.fuse(aux[0, anchors + depths]),
                                          placeholder)[None],
                              (anchors + depths)[None], visibility(anchors, depths)[None, None])[0, index]
        assert torch.allclose(flat, logits, atol=1e-5)  # what it cannot see does not change it
        kl = (teacher.exp() * (teacher - torch.log_softmax(flat, -1))).sum()
        assert float(kl) == pytest.approx(float(by_hand), abs=1e-6)
        assert float(sums.loss) == pytest.approx(sum(float(s) for s in sums.step_losses), rel=1e-6)


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"eagle3": {"mask_token_id": None}}, "eagle3.mask_token_id", "required with parallel_drafting"),
    ({"eagle3": {"mask_token_id": 482}}, "eagle3.mask_token_id", "vocabulary holds 482"),
    ({"eagle3": {"sequence_partitions": 2}}, "eagle3.sequence_partitions", "use 1"),
    ({"eagle3": {"ttt_steps": 3}}, "eagle3.ttt_steps", "P-EAGLE replaces"),
    ({"eagle3": {"down_sample_ratio": 1.5}}, "eagle3.down_sample_ratio", "(0, 1]"),
    ({"eagle3": {"parallel_drafting": False}}, "eagle3.num_depths", "set parallel_drafting: true"),
    ({"peft": {"dim": 8}}, "peft", "P-EAGLE trains the draft whole"),
    ({"packed_sequence": {"packed_sequence_size": 128}}, "packed_sequence.packed_sequence_size", "per row"),
])
def test_what_peagle_cannot_act_on_is_refused_with_the_reason(chat_target, tmp_path, change, key, words):
    cfg = peagle_config(tmp_path / "peagle.yaml", chat_target, tmp_path / "run")
    assert_refused("eagle3", cfg, tmp_path, change, key, words)
