"""Gemma 4's thinking-channel prefix (upstream's gemma4_prefix_collate_fn / gemma4_inject_thinking_prefix): inserted
after every model turn marker, never labelled, rows re-padded, cut to max_length but never through image tokens.

No Gemma 4 processor can be built offline here (transformers' needs torchvision for its video processor): the
processor is the tiny Llava one over a tokenizer saved by the fixture, the shipped tiny tokenizer plus Gemma 4's turn
and channel tokens and a chat template in Gemma 4's form.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from vlm_testing import IMAGE_PROCESSOR_DIR, LLAVA_CONFIG, TOKENIZER_DIR

from automodel import testing
from automodel.errors import AutomodelError
from automodel.training.modules import unwrap
from automodel_vlm.datasets import VLMCollator
from automodel_vlm.datasets.collate import IGNORE_INDEX
from automodel_vlm.datasets.gemma4 import Gemma4PrefixCollator, inject_thinking_prefix, marker_ends, thinking_prefix_ids
from automodel_vlm.processor import build_processor

FORM = Path(__file__).parent / "upstream_forms" / "gemma4_upstream.yaml"
GEMMA4_TOKENS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>"]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
            "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<turn|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}")
RED = Image.new("RGB", (32, 32), (200, 30, 30))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer with Gemma 4's turn and channel tokens and template; the tiny Llava config sized to it."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("gemma4")
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA4_TOKENS})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(root / "tokenizer"))
    config = json.loads(LLAVA_CONFIG.read_text())
    config["text_config"]["vocab_size"] = len(tokenizer)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(config))
    return {"tokenizer": root / "tokenizer", "config": root / "model" / "config.json"}


def gemma4_processor(assets: dict[str, Path], padding_side: str = "right"):
    processor = build_processor(str(IMAGE_PROCESSOR_DIR), str(assets["tokenizer"]), patch_size=8,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1)
    processor.tokenizer.padding_side = padding_side
    return processor


def sample(*turns: str, image_last: bool = False) -> dict:
    """A conversation of alternating user / assistant texts, the image in the first user turn."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": text}]}
                for i, text in enumerate(turns)]
    first = messages[0]["content"]
    messages[0]["content"] = first + [{"type": "image"}] if image_last else [{"type": "image"}] + first
    return {"messages": messages, "images": [RED]}


def real(batch: dict, key: str, row: int) -> list[int]:
    return batch[key][row][batch["attention_mask"][row] == 1].tolist()


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_the_prefix_follows_every_model_turn_and_is_never_a_label(assets, padding_side):
    processor = gemma4_processor(assets, padding_side)
    marker, prefix = thinking_prefix_ids(processor.tokenizer)
    samples = [sample("What colour is it?", "red", "And the shape?", "a square"), sample("Colour?", "red")]
    batch = Gemma4PrefixCollator(processor)(samples)
    plain = VLMCollator(processor)(samples)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert batch["input_ids"].shape[1] == max(lengths), "rows re-padded to the longest"
    for row, turns in enumerate([2, 1]):
        mask = batch["attention_mask"][row].tolist()
        pads = [0] * (len(mask) - lengths[row])
        assert mask == (pads + [1] * lengths[row] if padding_side == "left" else [1] * lengths[row] + pads)
        ids, labels = real(batch, "input_ids", row), real(batch, "labels", row)
        ends = marker_ends(ids, marker)
        assert len(ends) == turns and lengths[row] == len(real(plain, "input_ids", row)) + turns * len(prefix)
        inserted = {end + k for end in ends for k in range(len(prefix))}
        for end in ends:
            assert ids[end:end + len(prefix)] == prefix
        assert all(labels[i] == IGNORE_INDEX for i in inserted), "the prefix is context, not a label"
        # without the inserted tokens, the row and its labels are the default collation's: answers still labelled
        kept = [i for i in range(len(ids)) if i not in inserted]
        assert [ids[i] for i in kept] == real(plain, "input_ids", row)
        assert [labels[i] for i in kept] == real(plain, "labels", row)
        assert all(labels[i] == ids[i] for i in range(len(ids)) if labels[i] != IGNORE_INDEX)
    answers = [t for t in real(batch, "labels", 0) if t != IGNORE_INDEX]
    assert processor.tokenizer.decode(answers) == "red<turn|>\na square<turn|>\n"


def test_the_hook_form_extends_token_types_and_leaves_media_alone(assets):
    processor = gemma4_processor(assets)
    _, prefix = thinking_prefix_ids(processor.tokenizer)
    texts = [processor.apply_chat_template(s["messages"], tokenize=False) for s in
             (sample("Colour?", "red", "Shape?", "round"), sample("Colour?", "red"))]
    batch = dict(processor(text=texts, images=[RED, RED], return_tensors="pt", padding=True))
    image = batch["input_ids"] == processor.image_token_id
    batch["mm_token_type_ids"] = image.long()
    pixels, before = batch["pixel_values"], batch["attention_mask"].sum(1)
    out = inject_thinking_prefix(batch, processor)
    assert out["pixel_values"] is pixels
    assert out["input_ids"].shape == out["mm_token_type_ids"].shape == out["attention_mask"].shape
    assert (out["attention_mask"].sum(1) - before).tolist() == [2 * len(prefix), len(prefix)]
    assert torch.equal(out["mm_token_type_ids"].bool(), out["input_ids"] == processor.image_token_id)


def test_without_gemma4_tokens_nothing_is_inserted(processor):
    samples = [sample("What colour is it?", "red"), sample("Shape?", "a long answer here")]
    with pytest.warns(UserWarning, match="no Gemma 4 turn and channel tokens"):
        collate = Gemma4PrefixCollator(processor)
    batch, plain = collate(samples), VLMCollator(processor)(samples)
    assert batch.keys() == plain.keys() and all(torch.equal(batch[k], plain[k]) for k in batch)
    ids = plain["input_ids"].clone()
    assert torch.equal(inject_thinking_prefix(dict(plain), processor)["input_ids"], ids)


def test_max_length_cuts_text_after_the_insertion_never_image_tokens(assets):
    processor = gemma4_processor(assets)
    samples = [sample("What colour?", "a deep and dark red, " * 3), sample("Colour?", "red")]
    full = Gemma4PrefixCollator(processor)(samples)
    longest, shortest = full["attention_mask"].sum(1).tolist()
    limit = (longest + shortest) // 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cut = Gemma4PrefixCollator(processor, max_length=limit)(samples)
    assert cut["input_ids"].shape == (2, limit)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(cut[key][0], full[key][0, :limit]), key
        assert torch.equal(cut[key][1, :shortest], full[key][1, :shortest]), key
    assert cut["attention_mask"][1, shortest:].sum() == 0 and (cut["labels"][1, shortest:] == IGNORE_INDEX).all()
    late = [sample("A long question before the picture comes " * 2, "red", image_last=True)]
    ids = Gemma4PrefixCollator(processor)(late)["input_ids"][0].tolist()
    first_image = ids.index(processor.image_token_id)
    with pytest.raises(AutomodelError, match="collate_fn.max_length: .* cuts through the image tokens"):
        Gemma4PrefixCollator(processor, max_length=first_image + 2)(late)


def test_upstream_collate_form_validates_and_trains_three_steps_through_the_cli(assets, tmp_path):
    overrides = ["--processor.tokenizer", assets["tokenizer"], "--model.config", assets["config"]]
    checked = testing.run_cli("validate", "-c", FORM, *overrides, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    recipe = testing.train_inprocess(FORM, *overrides, "--checkpoint.checkpoint_dir", tmp_path / "setup",
                                     route=("finetune", "vlm"), setup_only=True)
    train, validation = recipe.dataloader.collate_fn.fn, recipe.val_dataloaders["validation"].collate_fn.fn
    assert isinstance(train, Gemma4PrefixCollator) and isinstance(validation, Gemma4PrefixCollator)
    assert (train.max_length, validation.max_length, train.injector is not None) == (64, None, True)
    config = unwrap(recipe.model).config  # backend.attn: the language model's; attn_implementation: the tower's
    assert (config.text_config._attn_implementation, config.vision_config._attn_implementation) == ("sdpa", "eager")
    result = testing.run_cli("finetune", "vlm", "-c", FORM, *overrides, "--checkpoint.checkpoint_dir",
                             tmp_path / "ckpt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: model.backend.attn makes 'sdpa' the language model's attention, attn_implementation 'eager'" \
        in result.stdout + result.stderr
    assert list(testing.losses_by_step(tmp_path / "ckpt" / "training.jsonl")) == [3]
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "validation.jsonl")] == [3]


HOOK = "nemo_automodel.components.datasets.vlm.collate_fns.gemma4_inject_thinking_prefix"


def test_the_packing_hook_inserts_the_prefix_in_each_packed_sample_token_by_token(assets, tmp_path):
    """packed_sequence.post_tokenize_hook_fn: each sample of a packed row is the processor's tokens with the prefix
    after every model turn marker (what upstream's hook makes of them), the prefix unlabelled, the rest labelled as
    without the hook; text-only and image samples alike."""
    from vlm_testing import tulu_rows, write_jsonl

    from automodel_vlm.datasets import make_tulu3_dataset
    from automodel_vlm.datasets.packing import PackedVLMCollator, VLMPackedSequenceConfig

    processor = gemma4_processor(assets)
    marker, prefix = thinking_prefix_ids(processor.tokenizer)
    chats = make_tulu3_dataset(str(write_jsonl(tmp_path / "tulu.jsonl", tulu_rows())), split="train[:2]")
    samples = [chats[0], sample("Colour?", "red"), chats[1]]
    settings = VLMPackedSequenceConfig(pack_size=256, post_tokenize_hook_fn=HOOK)
    assert isinstance(settings.sample_collator(processor), Gemma4PrefixCollator)
    row = PackedVLMCollator(settings.sample_collator(processor), settings.pack_size)([samples])
    plain = VLMPackedSequenceConfig(pack_size=256).sample_collator(processor)
    start = 0
    for one in samples:
        alone = plain([one])
        ids, labels = alone["input_ids"][0].tolist(), alone["labels"][0].tolist()
        labels[0] = IGNORE_INDEX  # a packed sample's first token predicts nothing
        expected_ids, expected_labels = [], []
        for position, (token, label) in enumerate(zip(ids, labels, strict=True)):
            expected_ids.append(token)
            expected_labels.append(label)
            if ids[max(position + 1 - len(marker), 0):position + 1] == marker:
                expected_ids += prefix
                expected_labels += [IGNORE_INDEX] * len(prefix)
        end = start + len(expected_ids)
        assert row["input_ids"][0, start:end].tolist() == expected_ids
        assert row["labels"][0, start:end].tolist() == expected_labels
        hooked = inject_thinking_prefix(dict(processor(text=[processor.apply_chat_template(
            one["messages"], tokenize=False)], images=one["images"] or None, return_tensors="pt",
            add_special_tokens=False)), processor)
        assert hooked["input_ids"][0].tolist() == expected_ids, "upstream's hook on the sample's tokens"
        assert expected_ids.count(prefix[0]) == len(marker_ends(ids, marker)) >= 1
        start = end
    assert int(row["token_count"][0]) == start


def test_upstream_text_only_form_packs_with_the_hook_and_trains_three_steps_through_the_cli(assets, tmp_path):
    from vlm_testing import magicoder_rows, tulu_rows, write_jsonl

    from automodel_vlm.datasets.packing import PackedVLMDataset

    form = FORM.parent / "gemma4_tulu3_text_upstream.yaml"
    tulu = write_jsonl(tmp_path / "tulu.jsonl", tulu_rows())
    overrides = ["--processor.tokenizer", assets["tokenizer"], "--model.config", assets["config"],
                 "--dataset.path_or_dataset", tulu, "--validation_dataset.tulu_path_or_dataset", tulu,
                 "--validation_dataset.magicoder_path_or_dataset",
                 write_jsonl(tmp_path / "magicoder.jsonl", magicoder_rows())]
    checked = testing.run_cli("validate", "-c", form, *overrides, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    recipe = testing.train_inprocess(form, *overrides, "--checkpoint.checkpoint_dir", tmp_path / "setup",
                                     route=("finetune", "vlm"), setup_only=True)
    packed = recipe.train_dataset
    assert isinstance(packed, PackedVLMDataset) and isinstance(packed.collator, Gemma4PrefixCollator)
    assert isinstance(recipe.dataloader.collate_fn.fn.collator, Gemma4PrefixCollator)
    assert sum(len(r) for r in packed.rows) == len(tulu_rows()), "none longer than max_length"
    assert len(packed) >= 6 and max(len(r) for r in packed.rows) > 1, "rows of several samples"
    assert len(recipe.val_dataloaders["validation"].dataset) == 8, "limit_total"
    result = testing.run_cli("finetune", "vlm", "-c", form, *overrides, "--checkpoint.checkpoint_dir",
                             tmp_path / "ckpt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(testing.losses_by_step(tmp_path / "ckpt" / "training.jsonl")) == [3]
    assert [r["step"] for r in testing.read_jsonl(tmp_path / "ckpt" / "validation.jsonl")] == [3]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_under_context_parallelism_rows_are_padded_to_the_chunks_multiple(assets, padding_side):
    """cp 2: the recipe hands the named collator pad_to_multiple_of 4 (2 x cp_size), as to its default collate; the
    rows, prefix included, are padded to a multiple of it, and their real tokens are those of the unpadded batch."""
    from types import SimpleNamespace

    from automodel.plugins.manager import get_plugin_manager
    from automodel.training.builders import configured_collate
    from automodel_vlm.recipe import FinetuneRecipeForVLM

    processor = gemma4_processor(assets, padding_side)
    recipe = FinetuneRecipeForVLM.__new__(FinetuneRecipeForVLM)
    recipe.cfg, recipe.processor = SimpleNamespace(distributed=SimpleNamespace(cp_size=2)), processor
    node = {"_target_": "nemo_automodel.components.datasets.vlm.collate_fns.gemma4_prefix_collate_fn"}
    collate = configured_collate(node, get_plugin_manager().resolver(), "dataloader.collate_fn",
                                 recipe.collate_runtime_args())
    unpadded = Gemma4PrefixCollator(processor)
    lengths = set()
    for answer in ("red", "a red square", "a red square on white, then a long tail of words"):
        samples = [sample("Colour?", answer), sample("Shape?", "round", "And?", answer)]
        batch, plain = collate(samples), unpadded(samples)
        lengths.add(batch["input_ids"].shape[1])
        assert batch["input_ids"].shape[1] % 4 == 0 and batch["input_ids"].shape[1] - plain["input_ids"].shape[1] < 4
        for row in range(2):
            for key in ("input_ids", "labels"):
                assert real(batch, key, row) == real(plain, key, row)
    assert len(lengths) > 1
