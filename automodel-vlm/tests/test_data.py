"""Image conversations: reading rows (JSONL / parquet, paths / bytes / inline parts), clear errors, and the
collate function's labels (assistant turns only)."""

from __future__ import annotations

import json
import shutil

import pytest
from vlm_testing import SHAPES, conversation, train_inprocess, write_jsonl

from automodel.errors import AutomodelError
from automodel.testing import read_jsonl
from automodel_vlm.datasets import ImageTextChatDataset, VLMCollator
from automodel_vlm.datasets.collate import IGNORE_INDEX, carry_labels


def labelled_segments(processor, input_ids, labels) -> list[str]:
    """The labelled stretches of one row, decoded (special tokens kept)."""
    segments, current = [], []
    for token, label in zip(input_ids.tolist(), labels.tolist(), strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            segments.append(processor.tokenizer.decode(current))
            current = []
    if current:
        segments.append(processor.tokenizer.decode(current))
    return segments


def test_collate_puts_the_loss_on_assistant_turns_only(processor):
    rows = read_jsonl(SHAPES / "train.jsonl")[:2]
    dataset = ImageTextChatDataset(str(SHAPES / "train.jsonl"), limit_dataset_samples=2)
    assert len(dataset) == 2
    sample = dataset[0]
    assert sample["images"][0].mode == "RGB" and sample["images"][0].size == (32, 32)
    batch = VLMCollator(processor)([dataset[0], dataset[1]])
    assert set(batch) == {"input_ids", "attention_mask", "pixel_values", "labels"}
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    image_id = processor.image_token_id
    for row in range(2):
        answer = rows[row]["messages"][1]["content"][0]["text"]
        assert labelled_segments(processor, batch["input_ids"][row], batch["labels"][row]) == [f" {answer}</s>\n"]
        assert int((batch["input_ids"][row] == image_id).sum()) == 16
    assert (batch["labels"][batch["input_ids"] == image_id] == IGNORE_INDEX).all()
    # the two questions differ in length: the shorter row is right-padded, its padding unlabelled
    lengths = batch["attention_mask"].sum(1)
    assert lengths[0] != lengths[1]
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_collate_labels_every_assistant_turn_of_a_multi_turn_conversation(processor, tmp_path):
    messages = [{"role": "system", "content": "Describe the image."},
                *conversation("What colour is the shape?", "red"),
                {"role": "user", "content": [{"type": "text", "text": "What shape is it?"}]},
                {"role": "assistant", "content": "circle"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"image": str(SHAPES / "images" / "train_0002.png"),
                                                  "messages": messages}])
    dataset = ImageTextChatDataset(str(path))
    batch = VLMCollator(processor)([dataset[0]])
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert text.startswith("<s>system: Describe the image.\nuser:<image>") and text.endswith("circle</s>\n")
    assert labelled_segments(processor, batch["input_ids"][0], batch["labels"][0]) == [" red</s>\n", " circle</s>\n"]


def test_collate_pads_token_rows_of_a_text_data_set_as_they_are(processor):
    """An LLM chat data set's samples under the VLM recipe (upstream's Gemma 4 text-only configs): token lists with
    their labels, right-padded with the tokenizer's pad id, no processor call; max_length truncates and pads to it,
    with drop_overlong it leaves the longer rows out."""
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [5, 9], "labels": [-100, 9]}]
    pad = processor.tokenizer.pad_token_id
    batch = VLMCollator(processor, pad_to_multiple_of=4)(rows)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 9, pad, pad]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 9, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert VLMCollator(processor, max_length=3)(rows)["input_ids"].tolist() == [[5, 6, 7], [5, 9, pad]]
    assert VLMCollator(processor, max_length=3, drop_overlong=True)(rows)["input_ids"].tolist() == [[5, 9, pad]]


def test_carry_labels_over_expanded_placeholders():
    ids, mask = [1, 4, 7, 8, 9], [False, False, False, True, True]
    assert carry_labels(ids, mask, [1, 4, 4, 4, 7, 8, 9], {4}) == [-100] * 5 + [8, 9]
    # a processor that also inserts other tokens around the image: the general alignment finds the answer
    assert carry_labels(ids, mask, [1, 50, 4, 4, 51, 7, 8, 9], {4}) == [-100] * 6 + [8, 9]


def _rows(n: int) -> list[dict]:
    return [{"image": f"images/train_{i:04d}.png", "messages": conversation("What colour is the shape?", "red")}
            for i in range(n)]


def test_missing_image_file_names_key_file_and_row(tmp_path):
    rows = _rows(3)
    rows[1]["image"] = "images/nope.png"
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(AutomodelError) as err:
        ImageTextChatDataset(str(path), config_key="validation_dataset", image_root=str(SHAPES))
    message = str(err.value)
    assert message.startswith("validation_dataset: row 2 of ") and str(path) in message
    assert "'images/nope.png' not found" in message and "validation_dataset.image_root" in message
    # without image_root the paths are relative to the data file's folder, where there are no images
    with pytest.raises(AutomodelError, match=r"dataset: row 1 of .*'images/train_0000.png' not found"):
        ImageTextChatDataset(str(path))


def test_conversation_without_assistant_turn_names_the_row(tmp_path):
    rows = _rows(3)
    rows[2]["messages"] = rows[2]["messages"][:1]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(AutomodelError, match=r"^dataset: row 3 of .*data.jsonl'.* no assistant turn .*roles: user"):
        ImageTextChatDataset(str(path), image_root=str(SHAPES))


def test_the_recipe_names_the_section_of_a_broken_data_set(make_config, tmp_path):
    rows = _rows(2)
    rows[1]["image"] = "missing.png"
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    config = make_config(validation_dataset={"path_or_dataset_id": str(path), "image_root": str(SHAPES),
                                             "limit_dataset_samples": None})
    with pytest.raises(AutomodelError, match=r"^validation_dataset: row 2 of .*'missing.png' not found"):
        train_inprocess(config, setup_only=True)


def test_image_count_must_match_the_image_parts(tmp_path):
    rows = _rows(1)
    rows[0]["image"] = ["images/train_0000.png", "images/train_0001.png"]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(AutomodelError, match=r"row 1 .*1 image part\(s\) in the messages but 2 image\(s\)"):
        ImageTextChatDataset(str(path), image_root=str(SHAPES))


def test_parquet_with_embedded_images(tmp_path, processor):
    import datasets
    from PIL import Image

    images = [Image.open(SHAPES / "images" / f"train_{i:04d}.png").convert("RGB") for i in range(3)]
    table = datasets.Dataset.from_dict({
        "image": images,
        "messages": [json.dumps(conversation("What shape is it?", "square")) for _ in range(3)],
    }).cast_column("image", datasets.Image())
    path = tmp_path / "train.parquet"
    table.to_parquet(str(path))
    dataset = ImageTextChatDataset(str(tmp_path), split="train")  # a folder with train.parquet
    assert len(dataset) == 3
    for i in range(3):
        got = dataset[i]["images"][0]
        assert got.size == (32, 32) and got.tobytes() == images[i].tobytes()
    batch = VLMCollator(processor)([dataset[0], dataset[1]])
    assert batch["pixel_values"].shape[0] == 2
    assert labelled_segments(processor, batch["input_ids"][0], batch["labels"][0]) == [" square</s>\n"]


def test_inline_image_parts_image_lists_and_rows_without_placeholders(tmp_path, processor):
    folder = tmp_path / "pictures"
    folder.mkdir()
    for i in range(2):
        shutil.copy(SHAPES / "images" / f"train_{i:04d}.png", folder / f"{i}.png")
    two = {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": "What colour is the shape?"}]}
    rows = [
        {"messages": conversation("What shape is it?", "square", image="0.png")},  # inline, relative to image_root
        {"images": ["0.png", "1.png"], "messages": [two, {"role": "assistant", "content": "purple"}]},
        {"images": ["1.png"], "messages": [{"role": "user", "content": "What shape is it?"},
                                           {"role": "assistant", "content": "square"}]},  # no placeholder
    ]
    # one column layout for all rows (what a JSONL of mixed rows would need): a list of images per row
    rows[0]["images"] = []
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    dataset = ImageTextChatDataset(str(path), image_root=str(folder))
    assert [len(dataset[i]["images"]) for i in range(3)] == [1, 2, 1]
    assert dataset.samples[2][0][0]["content"][0] == {"type": "image"}  # placed before the first user text
    batch = VLMCollator(processor)([dataset[i] for i in range(3)])
    assert batch["pixel_values"].shape[0] == 4
    assert [int((row == processor.image_token_id).sum()) for row in batch["input_ids"]] == [16, 32, 16]
    for row, answer in enumerate(["square", "purple", "square"]):
        assert labelled_segments(processor, batch["input_ids"][row], batch["labels"][row]) == [f" {answer}</s>\n"]


def test_a_folder_reads_the_split_file_and_qa_pairs_hold_the_answers():
    dataset = ImageTextChatDataset(str(SHAPES), split="validation")
    rows = read_jsonl(SHAPES / "validation.jsonl")
    assert len(dataset) == len(rows) == 64
    index, prefix, answer = dataset.qa_pairs[5]
    assert index == 5 and prefix[-1]["role"] == "user" and answer == rows[5]["messages"][1]["content"][0]["text"]
    assert dataset[5]["images"][0].size == (32, 32)


@pytest.mark.parametrize("section, multiple", [({}, 4), ({"pad_to_multiple_of": 8}, 8)])
def test_a_named_collate_fn_pads_rows_for_context_parallelism_as_the_default_does(processor, section, multiple):
    """Upstream's cp configs name qwen2_5_collate_fn (VLMCollator here): under cp 2 its rows must be padded to a
    multiple of 2 x cp_size as the recipe's default collate pads them; a section's own pad_to_multiple_of wins."""
    from types import SimpleNamespace

    from PIL import Image

    from automodel.plugins.manager import get_plugin_manager
    from automodel.training.builders import configured_collate
    from automodel_vlm.recipe import FinetuneRecipeForVLM

    recipe = FinetuneRecipeForVLM.__new__(FinetuneRecipeForVLM)
    recipe.cfg, recipe.processor = SimpleNamespace(distributed=SimpleNamespace(cp_size=2)), processor
    node = {"_target_": "nemo_automodel.components.datasets.vlm.collate_fns.qwen2_5_collate_fn", **section}
    collate = configured_collate(node, get_plugin_manager().resolver(), "dataloader.collate_fn",
                                 recipe.collate_runtime_args())
    lengths = set()
    for answer in ("Red.", "A red square on a white ground.", "Red, then blue, then a long tail of words."):
        batch = collate([{"messages": conversation("Which colour?", answer),
                          "images": [Image.new("RGB", (32, 32), (200, 30, 30))]}])
        lengths.add(batch["input_ids"].shape[1])
    assert all(length % multiple == 0 for length in lengths) and len(lengths) > 1
