"""Packed VLM sequences (packed_sequence): a packed row's loss is its samples' losses, every key acts or is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vlm_testing import LLAVA_CONFIG, SHAPES

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.datasets import ImageTextChatDataset, VLMCollator
from automodel_vlm.datasets.packing import (
    PackedVLMCollator,
    PackedVLMDataset,
    VLMPackedSequenceConfig,
    greedy_rows,
    media_balanced_rows,
)

ROUTE = ("finetune", "vlm")
# The shapes samples have 30 or 31 tokens: max_length 30 leaves the 31s out, and at packing_ratio 0.9 a row of 61
# fills to 54 tokens, one sample (12 rows; 6 at ratio 1, 24 without max_length).
UPSTREAM_FORM = {"pretokenize": True, "max_length": 30, "pack_size": 61, "packing_ratio": 0.9,
                 "drop_long_samples": True}
SMALL_RUN = {"validation_dataset": None, "eval_generation": None, "dataloader": {"batch_size": 2},
             "dataset": {"limit_dataset_samples": 24}}


@pytest.fixture(scope="module")
def samples():
    """Shapes conversations whose answers differ in length (so samples differ in tokens)."""
    data = ImageTextChatDataset(str(SHAPES / "train.jsonl"), limit_dataset_samples=6)
    rows = [data[i] for i in range(len(data))]
    for i, row in enumerate(rows):
        answer = row["messages"][1]["content"][0]["text"]
        row["messages"][1]["content"][0]["text"] = " ".join([answer] * (1 + 3 * i))
    return rows


def _summed_loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "token_count")}
    logits = model(**inputs, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum")


def test_a_packed_row_loses_what_its_samples_lose_one_by_one(processor, samples):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(LLAVA_CONFIG)).eval()
    collator = VLMCollator(processor)
    rows = [samples[:2], samples[2:5]]  # two rows: the images of the batch are scattered across both, in order
    packed = PackedVLMCollator(collator, pack_size=256)(rows)
    assert "attention_mask" not in packed and packed["pixel_values"].shape[0] == 5
    with torch.no_grad():
        alone = sum(_summed_loss(model, collator([s])) for s in samples[:5])
        together = _summed_loss(model, packed)
        # the same row with positions that do not restart: attention crosses the samples and the loss differs
        crossing = _summed_loss(model, {**packed, "position_ids": torch.arange(256).expand(2, -1)})
    assert torch.allclose(together, alone, rtol=1e-5), (together, alone)
    assert not torch.allclose(crossing, alone, rtol=1e-4)  # 10x the tolerance above
    lengths = [collator([s])["input_ids"].shape[1] for s in samples[:2]]
    assert packed["position_ids"][0, lengths[0]] == 0 and packed["labels"][0, lengths[0]] == -100
    assert packed["token_count"].tolist() == [sum(lengths), sum(collator([s])["input_ids"].shape[1]
                                                                for s in samples[2:5])]


def _pack(samples, processor, **keys) -> PackedVLMDataset:
    return PackedVLMDataset(samples, VLMCollator(processor), VLMPackedSequenceConfig(**keys))


def test_each_packing_key_changes_the_rows(processor, samples):
    lengths = [VLMCollator(processor)([s])["input_ids"].shape[1] for s in samples]
    size = lengths[0] + lengths[1]
    assert _pack(samples, processor, pack_size=size).rows[0] == [0, 1]
    assert _pack(samples, processor, pack_size=size, packing_ratio=0.9).rows[0] == [0]  # rows fill to 90 %
    assert _pack(samples, processor, pack_size=size, max_packs=2).rows == [[0, 1], [2]]
    short = _pack(samples, processor, pack_size=1000, max_length=lengths[2])
    assert short.rows == [[0, 1, 2]] and short.left_out["max_length"] == 3
    with pytest.raises(AutomodelError, match="packed_sequence.pack_size: sample 3 has"):
        _pack(samples, processor, pack_size=lengths[2])
    dropped = _pack(samples, processor, pack_size=lengths[2], drop_long_samples=True)
    assert dropped.left_out["drop_long_samples"] == 3 and [i for row in dropped.rows for i in row] == [0, 1, 2]


def test_upstream_form_trains_three_steps_through_the_cli(make_config, tmp_path):
    config = make_config(packed_sequence=UPSTREAM_FORM, **SMALL_RUN,
                         step_scheduler={"max_steps": 3, "val_check_interval": 100, "checkpoint_interval": 100})
    result = testing.run_cli("finetune", "vlm", "-c", config, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "packed the training data into 12 rows of 61 tokens (12 left out by max_length)" in log, log[-3000:]
    steps = testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]


def test_drop_long_samples_and_collate_max_length_from_the_config_act(make_config, tmp_path):
    config = make_config(packed_sequence={**UPSTREAM_FORM, "max_length": 64, "pack_size": 30,
                                          "collate_max_length": 40}, **SMALL_RUN)
    recipe = testing.train_inprocess(config, route=ROUTE, setup_only=True)
    assert recipe.dataloader.dataset.left_out == {"max_length": 0, "drop_long_samples": 12}
    assert next(iter(recipe.dataloader))["input_ids"].shape == (2, 40)  # rows padded to collate_max_length
    with pytest.raises(AutomodelError, match="sample 0 has 31 tokens, more than pack_size"):
        testing.train_inprocess(config, "--packed_sequence.drop_long_samples", "false", "--checkpoint.checkpoint_dir",
                                tmp_path / "other", route=ROUTE, setup_only=True)


def _pair_gap(media: list[int]) -> int:
    """The largest image-token gap between the rows two data-parallel ranks take in one step (rows 2k and 2k+1)."""
    return max(abs(a - b) for a, b in zip(media[::2], media[1::2], strict=False))


def test_media_balanced_rows_place_every_sample_once_within_the_size_ordered_by_image_tokens():
    # (index, tokens, image tokens): images come two by two in data set order, as text-only samples do
    measured = [(i, 10 + i % 3, 16 * (i % 4 < 2)) for i in range(24)]
    balanced = media_balanced_rows(measured, 36, None)
    tokens = {i: n for i, n, _ in measured}
    media = [sum(16 * (i % 4 < 2) for i in row) for row in balanced]
    assert sorted(i for row in balanced for i in row) == list(range(24))
    assert all(sum(tokens[i] for i in row) <= 36 for row in balanced)
    assert media == sorted(media) and len(balanced) <= len(greedy_rows(measured, 36, None))
    assert balanced == media_balanced_rows(list(measured), 36, None)  # deterministic
    assert media_balanced_rows(measured, 36, 2) == balanced[:2]  # max_packs keeps the first rows of the order
    assert media_balanced_rows([(0, 50, 0), (1, 5, 0)], 36, None) == [[0], [1]]  # longer than a row: its own


def test_balance_media_tokens_evens_the_image_tokens_of_the_rows_a_step_takes(processor, samples):
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say red."}]},
                         {"role": "assistant", "content": [{"type": "text", "text": " ".join(["red"] * 8)}]}]}
    data = [samples[0], samples[0], text, text] * 2  # greedy pairs image samples with image samples
    collator = VLMCollator(processor)
    image, words = (collator([s])["input_ids"].shape[1] for s in (samples[0], text))
    assert image // 2 < words <= image  # the crafted sizes: two samples a row, whichever they are

    def media(rows):
        return [sum(bool(data[i]["messages"][0]["content"][0]["type"] == "image") for i in row) for row in rows]

    greedy = _pack(data, processor, pack_size=2 * image).rows
    balanced = _pack(data, processor, pack_size=2 * image, balance_media_tokens=True).rows
    assert _pair_gap(media(greedy)) == 2 and _pair_gap(media(balanced)) == 0
    assert sorted(i for row in balanced for i in row) == list(range(8)) and media(balanced) == [0, 0, 2, 2]


@pytest.mark.parametrize("override,key,needle", [
    (("--packed_sequence.packing_ratio", "1.5"), "packed_sequence.packing_ratio", "must be in (0, 1]"),
    (("--packed_sequence.pack_size", "1"), "packed_sequence.pack_size", "at least 2"),
    (("--packed_sequence.pretokenize", "false"), "packed_sequence.pretokenize", "set true"),
    (("--packed_sequence.max_length", "0"), "packed_sequence.max_length", "at least 1"),
    (("--packed_sequence.max_packs", "0"), "packed_sequence.max_packs", "at least 1"),
    (("--packed_sequence.collate_max_length", "60"), "packed_sequence.collate_max_length", "at least pack_size"),
    (("--packed_sequence.packing_format", "thd"), "packed_sequence.packing_format",
     "need a CUDA GPU and Transformer Engine"),
    (("--packed_sequence.packing_format", "flat"), "packed_sequence.packing_format", "use neat"),
    (("--packed_sequence.attn_implementation", "flash_attention_2", "--distributed",
      "{strategy: fsdp2, cp_size: 2}"), "packed_sequence.attn_implementation", "use sdpa"),
    (("--dataloader.collate_fn._target_", "automodel_vlm.datasets.VLMCollator"), "dataloader.collate_fn",
     "builds the training rows itself"),
])
def test_bad_packing_values_are_refused_with_the_key(make_config, override, key, needle):
    with pytest.raises(ConfigError) as info:
        testing.load_config(make_config(packed_sequence=UPSTREAM_FORM), *override, route=ROUTE)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert key in found and needle in found[key], found


def test_balanced_packing_trains_from_the_config(make_config, tmp_path, capsys):
    config = make_config(packed_sequence={**UPSTREAM_FORM, "pack_size": 100, "packing_ratio": 1.0,
                                          "max_length": 31, "balance_media_tokens": True, "packing_format": "neat",
                                          "attn_implementation": "sdpa"},
                         **SMALL_RUN, step_scheduler={"max_steps": 2, "val_check_interval": 100,
                                                      "checkpoint_interval": 100})
    recipe = testing.train_inprocess(config, route=ROUTE)
    assert "note: packed_sequence.attn_implementation: sdpa governs nothing this run" in capsys.readouterr().err
    rows = recipe.dataloader.dataset.rows
    assert sorted(i for row in rows for i in row) == list(range(24)) and [len(row) for row in rows] == [3] * 8
    lengths = [recipe.dataloader.dataset.collator([recipe.dataloader.dataset.dataset[i]])["input_ids"].shape[1]
               for i in rows[0]]
    assert lengths == [31, 31, 31]  # the longest samples first, not data set order
    assert [s["step"] for s in testing.read_jsonl(tmp_path / "ckpt" / "training.jsonl")] == [1, 2]


def test_validate_exits_2_naming_the_key(make_config, tmp_path):
    result = testing.run_cli_inprocess("validate", "-c", make_config(packed_sequence={"pretokenize": True}),
                                       cwd=tmp_path)
    assert result.returncode == 2 and "packed_sequence.pack_size" in result.stdout + result.stderr


def _tiny_qwen2_vl():
    """A tiny Qwen2-VL (from a config) and its processor (:func:`vlm_testing.tiny_qwen_vl_processor`)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from vlm_testing import tiny_qwen_vl_processor

    processor = tiny_qwen_vl_processor()
    tokenizer = processor.tokenizer
    config = Qwen2VLConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 32, "vocab_size": len(tokenizer), "initializer_range": 0.3,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 8,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval(), processor


def test_a_packed_row_of_a_multi_axis_rope_model_loses_what_its_samples_lose(samples):
    from automodel_vlm.datasets.packing import packing_unsupported, rope_index

    model, processor = _tiny_qwen2_vl()
    assert packing_unsupported(model) is None
    collator = VLMCollator(processor)
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say red."}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}
    rows = [[samples[0], text_only, samples[1]], [samples[2], samples[3]]]
    packed = PackedVLMCollator(collator, pack_size=128, rope_index=rope_index(model))(rows)
    assert packed["position_ids"].shape == (4, 2, 128) and "mm_token_type_ids" in packed
    with torch.no_grad():
        alone = sum(_summed_loss(model, collator([s])) for row in rows for s in row)
        together = _summed_loss(model, packed)
        text_row = packed["position_ids"][0]
        crossing = _summed_loss(model, {**packed, "position_ids": torch.cat([
            torch.arange(128).expand(1, 2, -1), packed["position_ids"][1:]])})
        # the text positions on every rope axis: the images' 2D placement is lost and the loss differs
        flat = _summed_loss(model, {**packed, "position_ids": text_row.expand(4, -1, -1)})
    assert torch.allclose(together, alone, rtol=1e-5), (together, alone)
    assert not torch.allclose(crossing, alone, rtol=1e-4) and not torch.allclose(flat, alone, rtol=1e-4)
    first = collator([samples[0]])["input_ids"].shape[1]
    assert text_row[0, first] == 0 and packed["position_ids"][1:, 0, first].tolist() == [0, 0, 0]


def test_a_rope_model_whose_forward_does_not_read_packed_positions_is_refused():
    from automodel_vlm.datasets.packing import packing_unsupported

    class OwnRope(torch.nn.Module):
        def get_rope_index(self, input_ids, **kwargs):
            return input_ids

    assert "does not read packed positions" in packing_unsupported(torch.nn.Sequential(OwnRope()))
