"""Gemma 4 trained jointly with its drafter (upstream's Gemma4WithDrafter, automodel_vlm.drafter): the teacher-forced
rounds equal transformers' own drafting loop, the loss is the base's plus the weighted drafter loss computed by hand,
weight 0 trains the base as plain fine-tuning does, upstream's form runs through the CLI and its output loads with
transformers' classes, and what cannot compose with it is refused at validation.

The models are a tiny Gemma 4 (2 layers of 32) and a tiny assistant (2 layers of 24), built from config dicts and
saved by the fixture; the tokenizer is the shipped tiny one (its vocabulary: 353 tokens, image token 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from vlm_testing import tulu_rows, write_jsonl

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel.meta_build import building_on_meta
from automodel.testing import write_yaml
from automodel.training.loss import MaskedCrossEntropy
from automodel_vlm.drafter import OWN_KEYS, Gemma4WithDrafter

FORM = Path(__file__).parent / "upstream_forms" / "gemma4_joint_drafter_upstream.yaml"
VOCAB = 360
TEXT = {"model_type": "gemma4_text", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "global_head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 0, "max_position_embeddings": 256}
VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}
SPECIAL = {"image_token_id": 4, "boi_token_id": 353, "eoi_token_id": 354, "video_token_id": 355,
           "audio_token_id": 356, "boa_token_id": 357, "eoa_token_index": 358}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny Gemma 4 base, its tiny assistant (drafter) and Tulu-3-form rows, saved."""
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("drafter")
    torch.manual_seed(0)
    base = Gemma4ForConditionalGeneration(Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config=None,
                                                       **SPECIAL))
    base.save_pretrained(str(root / "base"))
    text = dict(TEXT, hidden_size=24, intermediate_size=48, num_kv_shared_layers=2, vocab_size_per_layer_input=0)
    drafter = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=32))
    drafter.save_pretrained(str(root / "drafter"))
    return {"base": root / "base", "drafter": root / "drafter", "rows": write_jsonl(root / "tulu.jsonl", tulu_rows())}


def joint(saved: dict[str, Path], weight: float = 0.5, steps: int = 2, **switches: bool) -> Gemma4WithDrafter:
    return Gemma4WithDrafter.from_pretrained(str(saved["base"]), drafter_path=str(saved["drafter"]),
                                             drafter_loss_weight=weight, drafter_num_steps=steps, **switches).train()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 10 tokens, the second padded after 7; labels on all real tokens but the first two."""
    ids = torch.randint(10, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    return ids, mask, labels


def test_each_round_equals_transformers_drafting_loop_and_the_loss_is_computed_by_hand(saved):
    """Round k at position t, teacher-forced, gives the logits transformers' assistant gives at generation (one
    query at position t + 1 over the base's keys 0..t, fed x[t+1+k] and the previous round's projected state);
    the drafter loss is the sum over rounds of their summed cross entropy against x[t+2+k]."""
    model = joint(saved)
    ids, mask, labels = batch()
    model(ids, mask)
    rounds = list(model._rounds)
    base, drafter, embed = model.base, model.drafter, model.base.get_input_embeddings()
    expected = torch.zeros(())
    with torch.no_grad():
        ref = base(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_shared_kv_states=True)
        kv = dict(ref.shared_kv_states)
        for b in range(2):
            for t in range(8):
                state = ref.hidden_states[-1][b:b + 1, t:t + 1]
                for k in range(2):
                    shared = {n: (v[0][b:b + 1, :, :t + 1], v[1][b:b + 1, :, :t + 1]) for n, v in kv.items()}
                    out = drafter(inputs_embeds=torch.cat([embed(ids[b:b + 1, t + 1 + k:t + 2 + k]), state], -1),
                                  attention_mask=mask[b:b + 1, :t + 1], position_ids=torch.tensor([[t + 1]]),
                                  shared_kv_states=shared)
                    torch.testing.assert_close(drafter.lm_head(rounds[k][b, t]), out.logits[0, 0])
                    state = out.last_hidden_state
                    if t + 2 + k < 10 and labels[b, t + 2 + k] != -100:
                        expected += torch.nn.functional.cross_entropy(out.logits[0, 0], labels[b, t + 2 + k])
    got = model.drafter_loss(labels, MaskedCrossEntropy())
    torch.testing.assert_close(got, expected)
    assert got.requires_grad


def test_the_recipe_loss_is_the_base_loss_plus_the_weighted_drafter_loss(saved, tmp_path):
    """The recipe's loss on one batch: the base's summed next-token loss + weight x the drafter's, by hand."""
    rows = write_jsonl(tmp_path / "rows.jsonl", tulu_rows(4))
    recipe = testing.train_inprocess(FORM, *overrides(saved, rows), "--checkpoint.checkpoint_dir", tmp_path / "c",
                                     route=("finetune", "vlm"), setup_only=True)
    data = recipe.move_to_device(next(iter(recipe.dataloader)))
    loss = recipe.compute_loss(recipe.model, data)
    model = recipe.model
    with torch.no_grad():
        logits = model.base(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    base = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                             data["labels"][:, 1:].reshape(-1), reduction="sum")
    model(data["input_ids"], data["attention_mask"])
    drafter = model.drafter_loss(data["labels"], MaskedCrossEntropy())
    torch.testing.assert_close(loss, base + 0.5 * drafter)
    assert drafter > 0


def overrides(saved: dict[str, Path], rows: Path | None = None) -> list[str]:
    return ["--model.pretrained_model_name_or_path", str(saved["base"]), "--model.drafter_path", str(saved["drafter"]),
            "--dataset.path_or_dataset", str(rows or saved["rows"])]


def test_upstream_form_trains_through_the_cli_and_saves_what_transformers_loads(saved, tmp_path):
    from transformers import AutoModelForImageTextToText, Gemma4AssistantForCausalLM

    result = testing.run_cli("finetune", "vlm", "-c", FORM, *overrides(saved), "--checkpoint.checkpoint_dir",
                             tmp_path / "ckpt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert record["step"] == 3
    assert record["loss"] == pytest.approx(record["loss_base"] + 0.5 * record["loss_drafter"], rel=1e-5)
    assert "drafting round(s)" in result.stderr
    model_dir = tmp_path / "ckpt" / "epoch_0_step_3" / "model"
    base = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    drafter = Gemma4AssistantForCausalLM.from_pretrained(str(model_dir / "drafter"))
    before = Gemma4AssistantForCausalLM.from_pretrained(str(saved["drafter"]))
    assert type(base).__name__ == "Gemma4ForConditionalGeneration"
    assert not torch.equal(drafter.pre_projection.weight, before.pre_projection.weight), "the drafter trained"
    assert (model_dir / "tokenizer_config.json").is_file()
    assert "Gemma4AssistantForCausalLM.from_pretrained" in result.stderr

    def restored(recipe) -> None:  # a resume reads model/ and model/drafter/ back
        torch.testing.assert_close(recipe.model.drafter.pre_projection.weight, drafter.pre_projection.weight)
        torch.testing.assert_close(recipe.model.base.lm_head.weight, base.lm_head.weight)

    resumed = testing.train_inprocess(FORM, *overrides(saved), "--checkpoint.checkpoint_dir", tmp_path / "ckpt",
                                      "--restore_from.path", "latest", "--step_scheduler.max_steps", "4",
                                      route=("finetune", "vlm"), before_run=restored)
    assert resumed.step_scheduler.step == 4


def test_weight_zero_trains_the_base_as_plain_fine_tuning_does(saved, tmp_path):
    """drafter_loss_weight 0: the same losses step by step as fine-tuning the base alone."""
    joint_run = testing.train_inprocess(FORM, *overrides(saved), "--model.drafter_loss_weight", "0",
                                        "--step_scheduler.max_steps", "2", "--step_scheduler.log_interval", "1",
                                        "--checkpoint.enabled", "false",
                                        "--checkpoint.checkpoint_dir", tmp_path / "joint", route=("finetune", "vlm"))
    data = yaml.safe_load(FORM.read_text())
    data["model"] = {k: v for k, v in data["model"].items() if k not in OWN_KEYS}
    data["model"]["_target_"] = "nemo_automodel.NeMoAutoModelForImageTextToText.from_pretrained"
    plain = testing.train_inprocess(write_yaml(tmp_path / "plain.yaml", data), *overrides(saved)[4:],
                                    "--model.pretrained_model_name_or_path", str(saved["base"]),
                                    "--step_scheduler.max_steps", "2", "--step_scheduler.log_interval", "1",
                                    "--checkpoint.enabled", "false",
                                    "--checkpoint.checkpoint_dir", tmp_path / "plain", route=("finetune", "vlm"))
    assert joint_run.step_losses == pytest.approx(plain.step_losses, rel=1e-6)
    assert len(plain.step_losses) == 2


@pytest.mark.parametrize(("override", "key", "needle"), [
    (("--distributed.tp_size", "2"), "distributed.tp_size", "not supported with Gemma4WithDrafter"),
    (("--distributed.pp_size", "2"), "distributed.pp_size", "not supported with Gemma4WithDrafter"),
    (("--distributed.cp_size", "2"), "distributed.cp_size", "not supported with Gemma4WithDrafter"),
    (("--peft.dim", "4"), "peft", "not implemented for Gemma4WithDrafter"),
    (("--packed_sequence.pack_size", "64"), "packed_sequence", "not supported with Gemma4WithDrafter"),
    (("--checkpoint.save_consolidated", "false"), "checkpoint.save_consolidated", "model/drafter/"),
    (("--model.drafter_num_steps", "0"), "model.drafter_num_steps", "1 or more"),
    (("--model.drafter_loss_weight", "-1"), "model.drafter_loss_weight", ">= 0"),
    (("--model.freeze_base_for_drafter", "1"), "model.freeze_base_for_drafter", "true or false"),
])
def test_what_cannot_compose_is_refused_at_validation(saved, override, key, needle):
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, *overrides(saved), *override, route=("finetune", "vlm"))
    found = {issue.key: issue.message for issue in info.value.issues}
    assert key in found and needle in found[key], found


def test_the_pair_is_built_whole_when_the_engine_asks_for_a_meta_build(saved):
    """The engine's meta-device build reads one directory into one model; the pair comes from two."""
    with building_on_meta() as meta:
        model = joint(saved)
    assert not meta.built
    assert not any(p.is_meta for p in model.parameters())


def test_upstreams_switches_freeze_the_base_and_copy_its_embedding(saved, tmp_path):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    frozen = joint(saved, freeze_base_for_drafter=True)
    assert not any(p.requires_grad for p in frozen.base.parameters())
    assert all(p.requires_grad for p in frozen.drafter.parameters())
    with pytest.raises(AutomodelError, match="share_embedding_with_base: the base's token embedding is"):
        joint(saved, share_embedding_with_base=True)
    text = dict(TEXT, num_kv_shared_layers=2, vocab_size_per_layer_input=0)  # the base's hidden size
    Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=32)).save_pretrained(
        str(tmp_path / "wide"))
    shared = Gemma4WithDrafter.from_pretrained(str(saved["base"]), drafter_path=str(tmp_path / "wide"),
                                               share_embedding_with_base=True)
    torch.testing.assert_close(shared.drafter.lm_head.weight, shared.base.get_input_embeddings().weight)
    assert shared.drafter.lm_head.weight is not shared.base.get_input_embeddings().weight, "they train apart"


def test_a_drafter_of_another_base_size_is_refused(saved):
    model = joint(saved)
    model.drafter.config.backbone_hidden_size = 48
    with pytest.raises(AutomodelError, match="hidden size 48, but this base's is 32"):
        Gemma4WithDrafter(model.base, model.drafter)
