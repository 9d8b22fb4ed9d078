"""Media through torch's pipeline splitter: each micro-batch's first stage gets exactly its rows' items (rows with
several, one or no images); stray keywords are refused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from automodel.errors import AutomodelError
from automodel.training.parallel.pipeline_media import media_kwargs, model_media


@pytest.mark.parametrize("chunks", [4, 2, 1])
def test_each_micro_batch_gets_its_rows_items_in_order(chunks):
    counts = torch.tensor([2, 0, 1, 3])
    images = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)  # the items of row 0, then row 1, ...
    kwargs = media_kwargs({"pixel_values": (images, counts)})
    assert kwargs["media_pixel_values"].shape == (4, 3, 3)
    _, split = split_args_kwargs_into_chunks((), kwargs, chunks)
    rows_per_chunk = 4 // chunks
    starts = torch.cumsum(counts, 0) - counts
    for index, chunk in enumerate(split):
        rows = range(index * rows_per_chunk, (index + 1) * rows_per_chunk)
        wanted = torch.cat([images[int(starts[r]): int(starts[r] + counts[r])] for r in rows])
        got = model_media(chunk)
        if len(wanted) == 0:
            assert got == {}  # rows without images: no pixel_values, as for a batch of such rows
        else:
            assert torch.equal(got["pixel_values"], wanted)


def test_a_keyword_that_is_not_media_is_refused():
    with pytest.raises(AutomodelError, match="was given 'pixel_values', which it does not take"):
        model_media({"pixel_values": torch.zeros(1, 3)})


def test_a_composite_model_is_cut_along_its_language_model_with_the_media_modules_on_the_first_stage():
    """A tiny Llava: its plan names the language model's parts (not the head, found as the output embeddings); the
    vision tower and projector are the first stage's alone; the names stay the one model's."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from automodel.training.parallel.pipeline_stages import split_model

    text = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       tie_word_embeddings=False)
    vision = {"model_type": "clip_vision_model", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 8, "patch_size": 4}
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False))
    first, = split_model(model, 0, 2)
    last, = split_model(model, 1, 2)
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    assert not set(first.state_dict()) & set(last.state_dict())
    assert first.media_modules == ["model.vision_tower", "model.multi_modal_projector"] and last.media_modules == []
    assert last.model.vision_tower is None and last.model.multi_modal_projector is None
    assert "lm_head.weight" in last.state_dict() and "model.language_model.embed_tokens.weight" in first.state_dict()
