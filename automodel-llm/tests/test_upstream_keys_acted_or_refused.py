"""Upstream keys that were refused as unknown (issue 20 item 1): each now acts as upstream's does (qat's
fake_quant_after_n_steps and qat_config), is metadata named in a note, or is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from automodel.errors import ConfigError
from automodel.testing import load_config, losses_by_step, train_inprocess, write_yaml

FORMS = Path(__file__).parent / "upstream_forms"


def refusals(config: Path, *overrides, route=("finetune", "llm")) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, *overrides, route=route)
    return {issue.key: issue.message for issue in info.value.issues}


def with_sections(tmp_path: Path, form: str, **sections) -> Path:
    data = yaml.safe_load((FORMS / form).read_text())
    data.update(sections)
    return write_yaml(tmp_path / f"with_{form}", data)


@pytest.mark.parametrize("section, node, words", [
    ("prewarm", {"cublas_backward": True, "comm_groups": False}, "cuBLAS's backward-pass workspaces"),
    ("prewarm", {"mamba_ssd_autotune": True}, "Triton autotuning of Mamba's SSD kernels"),
    ("tool_call_eval", {"_target_": "nemo_automodel.components.eval.tool_call_evaluator.ToolCallAccuracyEvaluator",
                        "path": "rows.jsonl", "sample_shard": [0, 2]}, "split over the data-parallel ranks"),
    ("dataloader", {"batch_size": 4, "dataloader_type": "single"}, "Megatron's sampler for Megatron's indexed"),
    ("validation_dataloader", {"dataloader_type": "cyclic"}, "which validation_dataset is not"),
    ("dataloader", {"batch_size": 4, "dataset": {"_target_": "automodel_llm.datasets.SquadDataset"}},
     "reads its data set from the top-level dataset section, not from inside the loader"),
])
def test_upstream_keys_that_cannot_act_are_refused_with_the_reason(tmp_path, section, node, words):
    found = refusals(with_sections(tmp_path, "recipe_bare_name.yaml", **{section: node}))
    key = next(k for k in found if k.startswith(section))
    assert words in found[key] and "unknown" not in found[key], found


def test_prewarm_off_distributed_config_and_longalign_validate_and_the_metadata_is_named_in_a_note(tmp_path):
    config = with_sections(tmp_path, "recipe_bare_name.yaml", longalign=False,
                           prewarm={"cublas_backward": False, "fla_gdn_autotune": False},
                           distributed_config={"_target_": "nemo_automodel.components.distributed.config.FSDP2Config"})
    _, cfg = load_config(config)
    assert cfg.prewarm.cublas_backward is False
    assert "'distributed_config' (upstream's FSDP2Config section" in cfg.notes[0]
    assert "'longalign' (a key of upstream's GLM-5.2 LoRA example that nothing in upstream reads)" in cfg.notes[0]


def test_qat_config_sets_the_quantizer_and_group_size_as_upstreams_does():
    form = FORMS / "qat_upstream_keys.yaml"
    _, cfg = load_config(form)
    assert (*cfg.qat.settings(), cfg.qat.fake_quant_after_n_steps) == ("int8_dynamic_act_int4_weight", 32, 1)
    _, cfg = load_config(form, "--qat.qat_config.quantizer_type", "int4_weight_only", "--qat.qat_config.groupsize",
                         "null")
    assert cfg.qat.settings() == ("int4_weight_only", 256)
    found = refusals(form, "--qat.group_size", "64")
    assert "64 disagrees with qat_config's 32" in found["qat.group_size"]
    found = refusals(form, "--qat.qat_config.padding_allowed", "true")
    assert "padding_allowed: torchao quantizer arguments not set here" in found["qat.qat_config"]
    found = refusals(form, "--qat.fake_quant_after_n_steps", "-1")
    assert "negative" in found["qat.fake_quant_after_n_steps"]


def test_fake_quantization_turns_on_after_n_steps(tmp_path, monkeypatch):
    """The first N steps train exactly as without QAT (the fake quantisers are off; the embeddings are untied, as
    torchao's swap of lm_head unties them); step N+1 differs, and so does a run with them on from the start."""
    form = FORMS / "qat_upstream_keys.yaml"
    losses = {}
    for name, extra in {"plain": ["--qat.enabled", "false"], "delayed": ["--qat.fake_quant_after_n_steps", "2"],
                        "from_start": ["--qat.fake_quant_after_n_steps", "0"]}.items():
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        train_inprocess(form, "--step_scheduler.val_every_steps", "null", "--step_scheduler.log_interval", "1",
                        "--model.tie_word_embeddings", "false", *extra)
        losses[name] = losses_by_step(tmp_path / name / "checkpoints" / "training.jsonl")
    plain, delayed, from_start = losses["plain"], losses["delayed"], losses["from_start"]
    assert [delayed[1], delayed[2]] == pytest.approx([plain[1], plain[2]], rel=1e-6)
    assert delayed[3] != pytest.approx(plain[3], rel=1e-6)
    assert from_start[1] != pytest.approx(plain[1], rel=1e-6)
    # resumed after step 1, the delay still ends after step 2: the same losses as the uninterrupted run
    (tmp_path / "resumed").mkdir()
    monkeypatch.chdir(tmp_path / "resumed")
    for steps in ("1", "3"):
        run = train_inprocess(form, "--step_scheduler.val_every_steps", "null", "--step_scheduler.log_interval", "1",
                        "--model.tie_word_embeddings", "false", "--qat.fake_quant_after_n_steps", "2",
                        "--step_scheduler.ckpt_every_steps", "1", "--step_scheduler.max_steps", steps)
    assert run.ctx.restore_path is not None and run.ctx.restore_path.name == "epoch_0_step_1"
    resumed = losses_by_step(tmp_path / "resumed" / "checkpoints" / "training.jsonl")
    assert [resumed[2], resumed[3]] == pytest.approx([delayed[2], delayed[3]], rel=1e-6)


def test_chat_dataset_masks_reasoning_content_in_the_assistant_turns(tmp_path):
    import json

    from transformers import AutoTokenizer

    from automodel_llm.datasets import ChatDataset

    template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %} thinking: "
                "{{ m.reasoning_content }} done.{% endif %} {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    turns = [{"role": "user", "content": "What is two plus two?"},
             {"role": "assistant", "content": "It is four.", "reasoning_content": "add the numbers"},
             {"role": "user", "content": "And three plus three?"},
             {"role": "assistant", "content": "It is six.", "reasoning_content": "again add them"}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "src" / "automodel_llm" / "examples" /
                                              "assets" / "tiny_tokenizer")

    def learned(mask: bool) -> str:
        sample = ChatDataset(str(data), tokenizer=tokenizer, chat_template=template, mask_reasoning_content=mask)[0]
        return tokenizer.decode([t if label != -100 else tokenizer.encode("|", add_special_tokens=False)[0]
                                 for t, label in zip(sample["input_ids"], sample["labels"], strict=True)])

    assert "add the numbers" in learned(False) and "again add them" in learned(False)
    masked = learned(True)
    assert "It is four." in masked and "It is six." in masked
    assert "add the numbers" not in masked and "again add them" not in masked and "thinking" not in masked


def test_packing_num_proc_one_is_what_packs_here_and_more_is_refused(tmp_path):
    packing = {"enabled": True, "packed_sequence_size": 128, "num_proc": 1}
    _, cfg = load_config(with_sections(tmp_path, "recipe_bare_name.yaml", packed_sequence=packing))
    assert cfg.packed_sequence.num_proc == 1
    found = refusals(with_sections(tmp_path, "recipe_bare_name.yaml", packed_sequence={**packing, "num_proc": 4}))
    assert "tokenized when built, before packing" in found["packed_sequence.num_proc"]


def test_packing_keys_of_upstreams_other_strategies_are_refused_unless_unset(tmp_path):
    """upstream's PackingConfig ``prepacked`` (false is what packs here) and NEAT's ``drop_long_samples``: never
    "unknown key"."""
    packing = {"enabled": True, "packed_sequence_size": 128}
    load_config(with_sections(tmp_path, "recipe_bare_name.yaml", packed_sequence={**packing, "prepacked": False}))
    found = refusals(with_sections(tmp_path, "recipe_bare_name.yaml",
                                   packed_sequence={**packing, "prepacked": True, "drop_long_samples": True}))
    assert "packing packs the samples the data set yields" in found["packed_sequence.prepacked"]
    assert "upstream's neat packing (packing_strategy: neat)" in found["packed_sequence.drop_long_samples"]
