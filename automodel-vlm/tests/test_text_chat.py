"""Upstream's text-only chat data for VLMs (make_tulu3_dataset, make_tulu3_magicoder_text_mix_dataset) over local
files in the hub sets' columns: conversations as upstream converts them, labels on the assistant tokens of the
rendered template only, text-only and image samples in one batch, and what is refused. The CLI run of upstream's
Gemma 4 text-only form (packed, with the thinking-prefix hook) is in test_gemma4.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vlm_testing import LLAVA_CONFIG, SHAPES, magicoder_rows, tulu_rows, write_jsonl

from automodel import testing
from automodel.errors import AutomodelError, ConfigError
from automodel_vlm.datasets import (
    ImageTextChatDataset,
    VLMCollator,
    make_tulu3_dataset,
    make_tulu3_magicoder_text_mix_dataset,
)
from automodel_vlm.datasets.collate import IGNORE_INDEX

FORM = Path(__file__).parent / "upstream_forms" / "gemma4_tulu3_text_upstream.yaml"


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text_chat")
    return {"tulu": write_jsonl(root / "tulu.jsonl", tulu_rows()),
            "magicoder": write_jsonl(root / "magicoder.jsonl", magicoder_rows())}


def text(value: str) -> list[dict]:
    return [{"type": "text", "text": value}]


def test_tulu3_rows_are_text_only_conversations_in_split_order(text_data):
    data = make_tulu3_dataset(str(text_data["tulu"]), split="train[:5]")
    assert len(data) == 5
    assert data[0] == {"messages": [{"role": "system", "content": text("Answer in one word.")},
                                    {"role": "user", "content": text("Which colour is number 0?")},
                                    {"role": "assistant", "content": text("Red.")}], "images": []}
    assert [m["role"] for m in data[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    every = make_tulu3_dataset(str(text_data["tulu"]))
    assert len(every) == len(tulu_rows()), "every row, as upstream"
    # upstream's conversion: the tool turn is left out, the user text loses its media placeholder and is stripped
    assert every[len(every) - 1]["messages"] == [{"role": "user", "content": text("Name a shape.")},
                                                 {"role": "assistant", "content": text("A circle.")}]


def test_labels_are_exactly_the_assistant_tokens_of_the_rendered_template(text_data, processor):
    """Row by row: the input is the tokenized template render; the labels are -100 over the system and user turns
    and the assistant's tokens (answer, end of turn) over each assistant turn."""
    data = make_tulu3_dataset(str(text_data["tulu"]), split="train[:2]")
    batch = VLMCollator(processor)([data[0], data[1]])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}, "no image tensors for text-only rows"
    tokenizer = processor.tokenizer

    def ids(value: str) -> list[int]:
        return tokenizer(value, add_special_tokens=False)["input_ids"]

    rendered = [processor.apply_chat_template(data[i]["messages"], tokenize=False) for i in range(2)]
    assert rendered[0] == "<s>system: Answer in one word.\nuser: Which colour is number 0?\nassistant: Red.</s>\n"
    segments = [[("<s>system: Answer in one word.\nuser: Which colour is number 0?\nassistant:", False),
                 (" Red.</s>\n", True)],
                [("<s>user: Which colour is number 1?\nassistant:", False), (" Green.</s>\n", True),
                 ("user: And the next?\nassistant:", False), (" blue.</s>\n", True)]]
    for row in range(2):
        real = batch["attention_mask"][row] == 1
        assert batch["input_ids"][row][real].tolist() == ids(rendered[row])
        expected = [token if labelled else IGNORE_INDEX for part, labelled in segments[row] for token in ids(part)]
        assert batch["labels"][row][real].tolist() == expected
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_a_batch_mixes_text_only_and_image_samples(text_data, processor):
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    chat = make_tulu3_dataset(str(text_data["tulu"]), split="train[:1]")[0]
    picture = ImageTextChatDataset(str(SHAPES / "train.jsonl"), limit_dataset_samples=1)[0]
    collate = VLMCollator(processor)
    batch = collate([chat, picture])
    alone = [collate([chat]), collate([picture])]
    assert batch["pixel_values"].shape[0] == 1, "the one image of the batch"
    for row, one in enumerate(alone):
        real = batch["attention_mask"][row] == 1
        assert batch["input_ids"][row][real].tolist() == one["input_ids"][0].tolist()
        assert batch["labels"][row][real].tolist() == one["labels"][0].tolist()
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig.from_dict(json.loads(LLAVA_CONFIG.read_text())))
    assert torch.isfinite(model(**batch).loss)


def test_the_mix_interleaves_both_sources_until_each_is_used_up(text_data):
    def conversations(data) -> list[str]:
        return [json.dumps(data[i]["messages"]) for i in range(len(data))]

    kwargs = {"tulu_path_or_dataset": str(text_data["tulu"]), "magicoder_path_or_dataset": str(text_data["magicoder"])}
    mixed = make_tulu3_magicoder_text_mix_dataset(max_turns=3, **kwargs)
    tulu = [row for row in tulu_rows() if len(row["messages"]) <= 3]  # max_turns
    solved = magicoder_rows()[:-1]  # the last has no solution
    drawn = conversations(mixed)
    # the mix's conversion: other roles (tool) left out, text as it is
    expected_tulu = {json.dumps([{"role": m["role"], "content": text(m["content"])} for m in row["messages"]
                                 if m["role"] != "tool"]) for row in tulu}
    expected_code = {json.dumps([{"role": "user", "content": text(row["problem"])},
                                 {"role": "assistant", "content": text(row["solution"])}]) for row in solved}
    assert set(drawn) == expected_tulu | expected_code, "every usable row of both drawn, nothing else"
    assert all(mixed[i]["images"] == [] for i in range(len(mixed)))
    assert conversations(make_tulu3_magicoder_text_mix_dataset(max_turns=3, **kwargs)) == drawn, "seeded"
    assert conversations(make_tulu3_magicoder_text_mix_dataset(max_turns=3, seed=7, **kwargs)) != drawn
    capped = make_tulu3_magicoder_text_mix_dataset(max_turns=3, limit_total=4, tulu_split="train[:6]", **kwargs)
    assert conversations(capped) == conversations(make_tulu3_magicoder_text_mix_dataset(
        max_turns=3, tulu_split="train[:6]", **kwargs))[:4]
    longer = make_tulu3_magicoder_text_mix_dataset(max_turns=16, **kwargs)
    assert any(len(longer[i]["messages"]) == 5 for i in range(len(longer))), "max_turns keeps longer ones"


def test_a_file_without_the_columns_is_named(text_data):
    with pytest.raises(AutomodelError, match=r"dataset.path_or_dataset: .* has no column messages"):
        make_tulu3_dataset(str(text_data["magicoder"]))
    with pytest.raises(AutomodelError, match=r"dataset.magicoder_path_or_dataset: .* has no column problem"):
        make_tulu3_magicoder_text_mix_dataset(tulu_path_or_dataset=str(text_data["tulu"]),
                                              magicoder_path_or_dataset=str(text_data["tulu"]))
    with pytest.raises(AutomodelError, match="dataset.inject_fake_images: true: no fake image"):
        make_tulu3_dataset(str(text_data["tulu"]), inject_fake_images=True)


@pytest.mark.parametrize("override,key,needle", [
    (("--packed_sequence.max_length", "null", "--dataset.truncate", "true"), "dataset.truncate",
     "packed_sequence.max_length is not set"),
    (("--packed_sequence", "null", "--dataset.truncate", "true"), "dataset.truncate", "packed_sequence is not given"),
    (("--dataset.inject_fake_images", "true"), "dataset.inject_fake_images", "no fake image"),
    (("--packed_sequence.post_tokenize_hook_fn", "automodel_vlm.datasets.gemma4.marker_ends"),
     "packed_sequence.post_tokenize_hook_fn", "the only hook on tokenized samples here is Gemma 4's"),
    (("--validation_dataset.streaming", "true"), "validation_dataset.streaming", "does not accept an argument"),
])
def test_what_cannot_act_is_refused_at_validation(override, key, needle):
    with pytest.raises(ConfigError) as info:
        testing.load_config(FORM, "--dataset.path_or_dataset", "x", *override, route=("finetune", "vlm"))
    found = {issue.key: issue.message for issue in info.value.issues}
    assert key in found and needle in found[key], found


def test_truncate_cuts_packed_samples_to_max_length_instead_of_leaving_them_out(text_data, processor):
    from automodel_vlm.datasets.packing import PackedVLMCollator, PackedVLMDataset, VLMPackedSequenceConfig

    chats = [make_tulu3_dataset(str(text_data["tulu"]), split="train[:4]", truncate=truncate) for truncate in
             (False, True)]
    collate = VLMCollator(processor)
    lengths = [collate([chats[0][i]])["input_ids"].shape[1] for i in range(4)]
    limit = min(lengths) + 1
    longer = sum(length > limit for length in lengths)
    assert longer >= 2
    settings = VLMPackedSequenceConfig(pack_size=256, max_length=limit)
    kept, cut = (PackedVLMDataset(data, collate, settings) for data in chats)
    assert (kept.left_out["max_length"], kept.cut, kept.cut_to) == (longer, 0, None)
    assert (cut.left_out["max_length"], cut.cut, cut.cut_to) == (0, longer, limit)
    row = PackedVLMCollator(cut.collator, 256, cut_to=cut.cut_to)([cut[0]])
    start = 0
    for index, length in enumerate(lengths):
        whole = collate([chats[0][index]])
        size = min(length, limit)
        assert row["input_ids"][0, start:start + size].tolist() == whole["input_ids"][0, :size].tolist()
        assert row["labels"][0, start + 1:start + size].tolist() == whole["labels"][0, 1:size].tolist(), \
            "labels built on the whole sample, then cut"
        start += size
    assert int(row["token_count"][0]) == start
    picture = ImageTextChatDataset(str(SHAPES / "train.jsonl"), limit_dataset_samples=1)
    picture.truncate = True
    with pytest.raises(AutomodelError, match="dataset.truncate: a sample of .* cut through its image tokens"):
        PackedVLMDataset(picture, collate, VLMPackedSequenceConfig(pack_size=256, max_length=4))
