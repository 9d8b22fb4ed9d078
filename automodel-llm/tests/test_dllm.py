"""Masked diffusion LM fine-tuning (``automodel finetune dllm``, upstream's ``DiffusionLMSFTRecipe`` in mode mdlm).

The logged loss is checked against a hand computation with transformers' own Llama (made bidirectional by its
config) on the first batch, with the masks the run's seeds draw; resuming draws the same masks; the saved model
attends both ways when transformers loads it; upstream's other modes and the keys that cannot act are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from llm_testing import ASSETS, PKG_DIR

from automodel import testing
from automodel.errors import ConfigError
from automodel.testing import read_jsonl, run_cli
from automodel.training.dist import planned_world_size
from automodel_llm.dllm import corrupt
from automodel_llm.row_seeds import RowSeeds

FORM = Path(__file__).parent / "upstream_forms" / "dllm_upstream.yaml"
ROUTE = ("finetune", "dllm")
MASK = 3  # the form's dllm.mask_token_id (the tiny tokenizer's <unk>)
CHAT = ASSETS / "tiny_chat"


@pytest.fixture(scope="module")
def form_args(tmp_path_factory):
    """A tiny Llama of fresh weights saved by transformers, and the shipped chat rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dllm")
    config = LlamaConfig.from_json_file(str(ASSETS / "tiny_llama" / "config.json"))
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(root / "model"))
    return ["--model.pretrained_model_name_or_path", root / "model", "--dataset.path_or_dataset_id",
            CHAT / "train.jsonl"]


def _by_hand(model_dir: Path, batch: dict[str, torch.Tensor], step: int, seed: int = 42) -> float:
    """The step's loss on one micro-batch (the step's only one here): the masks drawn as the run's seeds draw them,
    transformers' Llama with is_causal false on the corrupted rows (no attention mask), CE / rate summed over the
    masked tokens, over the supervised tokens (the answers and, supervise_padding, the padding)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir))
    model.config.is_causal = False
    padding = batch["attention_mask"] == 0
    ids = torch.where(padding, 0, batch["input_ids"])  # the tiny tokenizer's pad id
    targets = torch.where(padding, ids, batch["labels"])
    seeds = RowSeeds(seed)
    seeds.start("train", step)
    masked, rate = corrupt(ids, targets, batch["attention_mask"].sum(dim=1).tolist(), 1e-3, seeds)
    assert masked.any() and (~masked & (targets != -100)).any(), "some supervised tokens masked, some not"
    with torch.no_grad():
        logits = model(input_ids=torch.where(masked, MASK, ids)).logits
    nll = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
    return ((nll * masked / rate[:, None]).sum() / (targets != -100).sum()).item()


def _one_micro_batch(*args):
    return [*args, "--step_scheduler.global_batch_size", "4", "--step_scheduler.local_batch_size", "4"]


def test_the_logged_loss_is_the_masked_diffusion_loss_by_hand(form_args, tmp_path):
    first = testing.train_inprocess(FORM, *_one_micro_batch(*form_args), "--checkpoint.checkpoint_dir",
                                    tmp_path / "setup", route=ROUTE, setup_only=True)
    batch = next(iter(first.dataloader))
    assert (batch["attention_mask"] == 0).any(), "the first batch has padding (supervise_padding acts on it)"
    expected = _by_hand(Path(form_args[1]), batch, step=0)

    recipe = testing.train_inprocess(FORM, *_one_micro_batch(*form_args), "--step_scheduler.log_interval", "1",
                                     "--checkpoint.checkpoint_dir", tmp_path / "run", route=ROUTE)
    records = read_jsonl(tmp_path / "run" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-4)
    assert recipe.mask_token_id == MASK and recipe.eps == 1e-3
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "validation.jsonl")] == [3]


def test_without_padding_supervision_the_loss_covers_the_answers_only(form_args, tmp_path):
    counts = {}
    for value in ("true", "false"):
        recipe = testing.train_inprocess(FORM, *_one_micro_batch(*form_args), "--dllm.supervise_padding", value,
                                         "--checkpoint.checkpoint_dir", tmp_path / value, route=ROUTE, setup_only=True)
        batch = next(iter(recipe.dataloader))
        counts[value] = recipe.count_label_tokens(batch)
    answers = int((batch["labels"] != -100).sum())
    assert counts == {"false": answers, "true": answers + int((batch["attention_mask"] == 0).sum())}


def test_a_resumed_run_draws_the_same_masks(form_args, tmp_path):
    """Steps 3 and 4 of a run resumed from its step-2 checkpoint log the uninterrupted run's losses (the batches
    length-grouped and shuffled: the sampler resumes where it was)."""
    every = ("--step_scheduler.log_interval", "1", "--step_scheduler.val_every_steps", "100",
             "--lr_scheduler.lr_decay_style", "constant",  # the same rates in a 2-step and a 4-step run
             "--dataloader.group_by_length", "true", "--dataloader.shuffle", "true")
    testing.train_inprocess(FORM, *form_args, *every, "--step_scheduler.max_steps", "4",
                            "--checkpoint.checkpoint_dir", tmp_path / "whole", route=ROUTE)
    testing.train_inprocess(FORM, *form_args, *every, "--step_scheduler.max_steps", "2",
                            "--step_scheduler.ckpt_every_steps", "2", "--checkpoint.checkpoint_dir",
                            tmp_path / "parts", route=ROUTE)
    testing.train_inprocess(FORM, *form_args, *every, "--step_scheduler.max_steps", "4",
                            "--checkpoint.checkpoint_dir", tmp_path / "parts", route=ROUTE)
    whole = testing.losses_by_step(tmp_path / "whole" / "training.jsonl")
    parts = testing.losses_by_step(tmp_path / "parts" / "training.jsonl")
    assert sorted(parts) == [1, 2, 3, 4]
    assert parts == pytest.approx(whole, rel=1e-6)


def test_the_cli_trains_the_upstream_form_and_the_saved_model_attends_both_ways(form_args, tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_cli("run", "-c", FORM, *map(str, form_args), "--checkpoint.checkpoint_dir", tmp_path / "run",
                     cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "attention: bidirectional" in result.stderr
    model_dir = tmp_path / "run" / "epoch_0_step_3" / "model"
    assert json.loads((model_dir / "config.json").read_text())["is_causal"] is False
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    changed = ids.clone()
    changed[0, -1] = 10
    with torch.no_grad():
        first, second = (model(input_ids=x).logits[0, 0] for x in (ids, changed))
    assert not torch.allclose(first, second), "the first position sees the last token"


def test_the_shipped_example_trains_by_its_route(tmp_path):
    result = run_cli("finetune", "dllm", "-c", "llm/tiny_dllm", "--step_scheduler.max_steps", "3",
                     "--checkpoint.checkpoint_dir", tmp_path / "run", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "masked diffusion (mdlm): mask token 3" in result.stderr
    assert (tmp_path / "run" / "epoch_0_step_3" / "model" / "config.json").exists()
    saved = yaml.safe_load((tmp_path / "run" / "epoch_0_step_3" / "config.yaml").read_text())
    assert saved["recipe"] == "automodel_llm.dllm.DiffusionLMSFTRecipe", "the route's recipe, for automodel export"
    assert saved["dllm"]["mask_token_id"] == 3


def _issues(*overrides: str, route=ROUTE, config=FORM, world: int = 1) -> dict[str, str]:
    with planned_world_size(world, f"--nproc-per-node {world}"), pytest.raises(ConfigError) as err:
        testing.load_config(config, "--model.pretrained_model_name_or_path", ASSETS / "tiny_llama", *overrides,
                            route=route)
    return {issue.key: issue.message for issue in err.value.issues}


@pytest.mark.parametrize("mode, words", [("block_diffusion", "DiffusionGemma"), ("hybrid", "causal logits"),
                                         ("dflash", "frozen target model")])
def test_upstreams_other_modes_are_refused_with_the_reason(mode, words):
    assert words in _issues("--dllm.mode", mode)["dllm.mode"]


def test_keys_that_cannot_act_are_refused():
    assert "vocabulary has 482 tokens" in _issues("--dllm.mask_token_id", "999")["dllm.mask_token_id"]
    assert "the tokenizer has no mask token" in _issues("--dllm.mask_token_id", "null")["dllm.mask_token_id"]
    issues = _issues("--dllm.block_size", "32", "--distributed.tp_size", "2",
                     "--dataset.unshifted", "false", "--eval_generation.enabled", "true",
                     "--packed_sequence.packed_sequence_size", "64", world=2)
    assert "mode block_diffusion only" in issues["dllm.block_size"]
    assert "masking rate" in issues["distributed.tp_size"]
    assert "own position" in issues["dataset.unshifted"]
    assert "one next token at a time" in issues["eval_generation"]
    assert "both ways" in issues["packed_sequence"]


def test_the_next_token_recipe_refuses_upstreams_diffusion_sample_form():
    issues = _issues("--dataset.unshifted", "true", route=("finetune", "llm"),
                     config=PKG_DIR / "examples" / "tiny_dllm.yaml")
    assert "DiffusionLMSFTRecipe" in issues["dataset.unshifted"]


def _padding(loader) -> tuple[int, list[int]]:
    """(padding tokens, the sample rows' attention sums) over one pass of ``loader``."""
    padding, seen = 0, []
    for batch in loader:
        mask = batch["attention_mask"]
        padding += int((mask == 0).sum())
        seen += mask.sum(dim=1).tolist()
    return padding, seen


def test_group_by_length_batches_samples_of_similar_lengths(form_args, tmp_path):
    """Upstream's dataloader.group_by_length (its diffusion-LM configs set it): every sample once per epoch, in
    batches of samples of about one length, so less padding than the same loader without it."""
    runs = {}
    for value in ("false", "true"):
        recipe = testing.train_inprocess(FORM, *form_args, "--dataloader.group_by_length", value,
                                         "--dataloader.shuffle", "true", "--checkpoint.checkpoint_dir",
                                         tmp_path / value, route=ROUTE, setup_only=True)
        runs[value] = _padding(recipe.dataloader)
    assert sorted(runs["true"][1]) == sorted(runs["false"][1]), "the same samples, each once"
    assert runs["true"][0] < runs["false"][0] / 2
    assert type(recipe.dataloader.batch_sampler).__name__ == "BucketBatchSampler"


def test_group_by_length_that_cannot_act_is_refused():
    issues = _issues("--dataloader.group_by_length", "sometimes")
    assert "expected true or false" in issues["dataloader.group_by_length"]
    issues = _issues("--dataloader.group_by_length", "true", "--dataloader.dataloader_type", "cyclic")
    assert "remove one" in issues["dataloader.group_by_length"]


def test_transformers_loader_by_its_path_is_ours_and_keeps_remote_code_behind_the_flag():
    """Upstream's diffusion-LM configs name transformers.AutoModelForCausalLM.from_pretrained: it loads through
    ours, so a config's trust_remote_code: true still needs --trust-remote-code."""
    issues = _issues("--model._target_", "transformers.AutoModelForCausalLM.from_pretrained",
                     "--model.trust_remote_code", "true")
    assert list(issues) == ["model.trust_remote_code"] and "--trust-remote-code" in issues["model.trust_remote_code"]


# ---- mode idlm ------------------------------------------------------------------------------------------------

IDLM = ("--dllm.mode", "idlm", "--dllm.supervise_padding", "false", "--dllm.block_length", "1",
        "--dllm.clean_loss_weight", "0.2", "--model._target_", "transformers.AutoModelForCausalLM.from_pretrained",
        "--model.attn_implementation", "sdpa")


def _idlm_mask(length: int, valid: torch.Tensor) -> torch.Tensor:
    """I-DLM's attention over [x_t | x_0] with blocks of one token, written out key by key from its definition: a
    masked-copy token sees itself and the clean tokens before it; a clean token the clean tokens up to itself."""
    rows = valid.shape[0]
    mask = torch.full((rows, 1, 2 * length, 2 * length), float("-inf"))
    for row in range(rows):
        for q in range(2 * length):
            keys = [q, *(length + k for k in range(q))] if q < length else range(length, q + 1)
            for k in keys:
                if valid[row, k % length]:
                    mask[row, 0, q, k] = 0.0
    return mask


def _idlm_by_hand(model_dir: Path, batch: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(loss, CE(x_t), CE(x_0)) per answer token of the step's one micro-batch, with transformers' Llama."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir))
    ids, labels, valid = batch["input_ids"], batch["labels"], batch["attention_mask"]
    length = ids.shape[1]
    answers = labels != -100
    inputs = torch.cat([torch.where(answers, MASK, ids), ids], dim=1)
    positions = torch.arange(length).repeat(2)[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        logits = model(input_ids=inputs, position_ids=positions, attention_mask=_idlm_mask(length, valid)).logits
    following = labels[:, 1:]
    ce = [F.cross_entropy(half[:, :-1][following != -100], following[following != -100], reduction="sum")
          for half in (logits[:, :length], logits[:, length:])]
    tokens = answers.sum()
    return ((ce[0] + 0.2 * ce[1]) / tokens).item(), (ce[0] / tokens).item(), (ce[1] / tokens).item()


def test_idlm_logs_the_hand_computed_loss_and_its_parts(form_args, tmp_path):
    first = testing.train_inprocess(FORM, *_one_micro_batch(*form_args), *IDLM, "--checkpoint.checkpoint_dir",
                                    tmp_path / "setup", route=ROUTE, setup_only=True)
    batch = next(iter(first.dataloader))
    assert (batch["attention_mask"] == 0).any(), "padding keys are hidden from every query"
    loss, noisy, clean = _idlm_by_hand(Path(form_args[1]), batch)

    testing.train_inprocess(FORM, *_one_micro_batch(*form_args), *IDLM, "--step_scheduler.log_interval", "1",
                            "--checkpoint.checkpoint_dir", tmp_path / "run", route=ROUTE)
    record = read_jsonl(tmp_path / "run" / "training.jsonl")[0]
    assert record["loss"] == pytest.approx(loss, rel=1e-4)
    assert (record["loss_noisy"], record["loss_clean"]) == pytest.approx((noisy, clean), rel=1e-4)
    model_dir = tmp_path / "run" / "epoch_0_step_3" / "model"
    assert json.loads((model_dir / "config.json").read_text()).get("is_causal", True) is True, "a causal LM still"


def test_idlm_auto_balance_weighs_the_clean_loss_by_the_ratio(form_args, tmp_path):
    testing.train_inprocess(FORM, *_one_micro_batch(*form_args), *IDLM[:6], "--dllm.auto_balance_clean_loss", "true",
                            "--step_scheduler.max_steps", "1", "--step_scheduler.log_interval", "1",
                            "--checkpoint.checkpoint_dir", tmp_path, route=ROUTE)
    record = read_jsonl(tmp_path / "training.jsonl")[0]
    assert record["loss"] == pytest.approx(2 * record["loss_noisy"], rel=1e-5)


def test_idlm_settings_that_cannot_act_are_refused():
    issues = _issues("--dllm.mode", "idlm", "--dllm.mask_token_id", "null", "--dllm.eps", "0.01",
                     "--dllm.supervise_padding", "true", "--dllm.clean_loss_weight", "0.5",
                     "--dllm.auto_balance_clean_loss", "true")
    assert "needs it set" in issues["dllm.mask_token_id"]
    assert "mode mdlm" in issues["dllm.eps"]
    assert "answer tokens only" in issues["dllm.supervise_padding"]
    assert "remove one" in issues["dllm.clean_loss_weight"]
    issues = _issues(*IDLM, "--model.attn_implementation", "flash_attention_2")
    assert "flash_attention_2" in issues["model.attn_implementation"]
    assert "read by mode idlm only" in _issues("--dllm.block_length", "2")["dllm.block_length"]


def test_two_fsdp2_ranks_train_as_one_process_with_their_batches_together(form_args, tmp_path):
    """A row draws its mask from its own tokens, the step and the seed: two data-parallel ranks of 2 rows each give
    the losses of one process of 4 (the same rows per step, unshuffled; padding not supervised, as its amount
    follows each micro-batch's longest row)."""
    from automodel.testing import free_port

    common = [*map(str, form_args), "--dllm.supervise_padding", "false", "--step_scheduler.log_interval", "1",
              "--step_scheduler.global_batch_size", "4", "--step_scheduler.max_steps", "3"]
    one = run_cli("run", "-c", FORM, *common, "--step_scheduler.local_batch_size", "4",
                  "--checkpoint.checkpoint_dir", tmp_path / "one", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_cli("run", "-c", FORM, *common, "--step_scheduler.local_batch_size", "2", "--nproc-per-node", "2",
                  "--master-port", str(free_port()), "--checkpoint.checkpoint_dir", tmp_path / "two", cwd=tmp_path,
                  OMP_NUM_THREADS="1")
    assert two.returncode == 0, two.stderr[-4000:]
    one_losses = testing.losses_by_step(tmp_path / "one" / "training.jsonl")
    assert sorted(one_losses) == [1, 2, 3]
    assert testing.losses_by_step(tmp_path / "two" / "training.jsonl") == pytest.approx(one_losses, rel=1e-4)


def test_a_lora_adapter_exports_merged_into_a_base_that_attends_both_ways(form_args, tmp_path):
    """mdlm trains the adapter with attention both ways: automodel export merges it into the recorded base made
    bidirectional (its config.json says is_causal: false), giving the logits of peft's PeftModel over that base."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    testing.train_inprocess(FORM, *form_args, "--peft.dim", "4", "--peft.match_all_linear", "true",
                            "--checkpoint.checkpoint_dir", tmp_path / "run", route=ROUTE)
    result = run_cli("export", tmp_path / "run" / "epoch_0_step_3", tmp_path / "merged", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert merged.config.is_causal is False
    config = AutoConfig.from_pretrained(str(form_args[1]))
    config.is_causal = False  # as the run's final message says
    base = AutoModelForCausalLM.from_pretrained(str(form_args[1]), config=config)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "run" / "epoch_0_step_3" / "model"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
