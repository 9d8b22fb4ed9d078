"""Pipeline parallelism of the VLM recipe through the CLI on CPU ranks (gloo): ``distributed.pp_size: 2`` on two ranks
cuts the tiny Llava along its 2-layer language model (stage 0: vision tower, projector, embedding, layer 0; stage 1:
layer 1, norm, head) and trains with the per-step losses and gradient norms of one process on rows holding two, one
or no images (each pipeline micro-batch's first stage gets exactly its rows' images); the consolidated ``model/``
loads with transformers as the one process's weights, and with LoRA the saved adapter is the one process's; pp 2 x
cp 2 on four ranks (each first stage merges the images into the whole rows, then splits them) trains like one process
too; what the pipeline cannot take is refused by ``automodel validate`` with the numbers. Tiny Gemma 3 and Gemma 4
models (image tokens attending to each other both ways, a mask every stage builds from the rows' token types) run
through two stages like the whole model and train over pp 2 on two gloo ranks like one process (the worker script's
``vlm_pp_gemma`` scenario).

The ranks of the pipeline (and of its cp groups) read the same rows, so the one-process reference (run in the test's
process) has the same batch size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vlm_testing import SHAPES, assert_trains_like, train_inprocess, training_column, write_config, write_jsonl

from automodel.testing import free_port, run_cli, run_cli_inprocess

IMAGES_PER_ROW = [2, 0, 1, 1, 0, 2, 1, 2]  # two batches of four rows an epoch: 4 steps in two epochs
FOUR_STEPS = {"step_scheduler": {"max_steps": 4, "val_check_interval": 100, "checkpoint_interval": 4},
              "validation_dataset": None, "eval_generation": None, "dataloader": {"batch_size": 4, "shuffle": False},
              "freeze": {"vision_tower": False}}
PP2 = ["--nproc-per-node", "2", "--distributed.strategy", "fsdp2", "--distributed.pp_size", "2"]


def _mixed_images(directory: Path) -> Path:
    """Rows with two, one or no images (a text-only row has no image part), in the image-list column."""
    rows = []
    for index, count in enumerate(IMAGES_PER_ROW):
        question = {"type": "text", "text": "What colour is the shape?" if count else "Say red."}
        content = [{"type": "image"}] * count + [question]
        rows.append({"images": [str(SHAPES / "images" / f"train_{index + k:04d}.png") for k in range(count)],
                     "messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]})
    return write_jsonl(directory / "mixed.jsonl", rows)


def _config(tmp: Path, name: str, **sections: Any) -> Path:
    dataset = {"path_or_dataset_id": str(_mixed_images(tmp)), "limit_dataset_samples": None}
    return write_config(tmp / f"{name}.yaml", tmp / name, **{**FOUR_STEPS, **sections}, dataset=dataset)


def _one_process(tmp: Path, **sections: Any) -> Path:
    """The reference, run in this process (the CLI's path without a new interpreter)."""
    train_inprocess(_config(tmp, "one", **sections))
    return tmp / "one"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process on the mixed rows, full fine-tuning: the reference of pp 2 and of pp 2 x cp 2."""
    return _one_process(tmp_path_factory.mktemp("vlm_pp_one"))


def _pp2(tmp: Path, *args: str, env: dict[str, str] | None = None, **sections: Any) -> tuple[Path, str]:
    config = _config(tmp, "pp2", **sections)
    result = run_cli("finetune", "vlm", "-c", config, *PP2, *args, "--master-port", str(free_port()), cwd=tmp,
                     OMP_NUM_THREADS="1", **(env or {}))
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / "pp2", result.stderr


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_pp2_trains_like_one_process_on_rows_with_different_image_counts(tmp_path, lora, request):
    sections = {"peft": {"dim": 4, "alpha": 8, "match_all_linear": True, "dropout": 0.0}} if lora else {}
    # 1F1B over one-row micro-batches (two images, none, one, one); GPipe over two-row ones (two + none, one + one)
    schedule = ["--distributed.pipeline.pp_schedule", "gpipe", "--distributed.pipeline.pp_microbatch_size", "2"] \
        if lora else ["--distributed.pipeline.pp_schedule", "1f1b"]
    reference = _one_process(tmp_path, **sections) if lora else request.getfixturevalue("reference")
    out, log = _pp2(tmp_path, *schedule, **sections)
    assert "stage 0 of 2 on this rank (vision_tower + multi_modal_projector + embedding + layers 0-0)" in log
    assert_trains_like(out, reference, "epoch_1_step_4", lora)


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_packed_rows_keep_attention_within_each_sample_through_the_stages(tmp_path):
    """Packed rows (four conversations with two, none or one images a row, position ids restarting at each, no
    attention mask) through two stages: every stage gets the rows' position ids, so its attention stays within
    the samples, and the run has the losses, gradient norms and final weights of one process on the same packed
    rows (attention across the samples in any stage would change them)."""
    packed = {"packed_sequence": {"pack_size": 200}, "dataloader": {"batch_size": 2, "shuffle": False}}
    reference = _one_process(tmp_path, **packed)
    out, log = _pp2(tmp_path, "--distributed.pipeline.pp_schedule", "1f1b", **packed)
    assert "packed the training data into 2 rows of 200 tokens" in log
    assert_trains_like(out, reference, "epoch_3_step_4", lora=False)


@pytest.mark.slow
def test_pp2_x_cp2_merges_the_images_into_whole_rows_then_splits_them_like_one_process(tmp_path, reference):
    """pp 2 x cp 2 on four ranks: each cp rank's first stage runs the vision tower and merges the images into the
    whole rows (an image's tokens lie on one rank's part, the other rank's part holds none), then its language
    model's layer and the second stage run on the rank's part with the all-gather attention, with static stage
    shapes (the first stage's input the whole rows); the losses, gradient norms and final weights are one process's
    (splitting the token ids before the merge fails: a rank's part does not hold its images' tokens)."""
    out, log = _pp2(tmp_path, "--nproc-per-node", "4", "--distributed.cp_size", "2",
                    "--distributed.pipeline.pp_schedule", "1f1b", "--distributed.pipeline.pp_seq_len", "128",
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})  # torch checks each stage's tensors against them
    assert "all-gather attention" in log and "over cp 2" in log
    assert "static (pp_seq_len 128; this rank's part of the sequences, cp 2): token ids [1, 128] (the whole " \
        "rows: the first stage splits them after merging the media), hidden states [1, 64," in log
    for key in ("loss", "grad_norm"):
        assert training_column(out, key) == pytest.approx(training_column(reference, key), rel=1e-5), key
    assert_trains_like(out, reference, "epoch_1_step_4", lora=False)


def _validate(tmp: Path, *args: str, **sections: Any) -> str:
    config = write_config(tmp / "cfg.yaml", tmp / "ckpt", **sections)
    result = run_cli_inprocess("validate", "-c", config, "--nproc-per-node", "2", *args, cwd=tmp)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out, out
    return out


def test_more_stages_than_text_layers_and_generation_are_refused_by_validate(tmp_path):
    out = _validate(tmp_path, "--distributed.pipeline.pp_schedule", "interleaved1f1b",
                    distributed={"strategy": "fsdp2", "pp_size": 2})
    assert "2 ranks x 2 stages each = 4 stages, but the model has 2 layers (num_hidden_layers)" in out
    assert "eval_generation.enabled" in out and "the pipeline stages (pp_size 2) hold apart" in out


def test_a_model_without_a_media_layout_is_refused_by_validate(tmp_path):
    llava_next = {"model_type": "llava_next", "text_config": {"num_hidden_layers": 2, "tie_word_embeddings": False},
                  "tie_word_embeddings": False}
    out = _validate(tmp_path, model={"config": llava_next}, eval_generation=None,
                    distributed={"strategy": "fsdp2", "pp_size": 2})
    assert "distributed.pp_size" in out and "the model (llava_next) has no media layout here" in out
    assert ("(known: gemma3, gemma4, llava, mistral3, paligemma, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe, "
            "qwen3_vl, qwen3_vl_moe)") in out


@pytest.mark.parametrize("family", ["gemma3_pp", "gemma4_pp"])
def test_gemma_stages_build_the_whole_models_two_way_masks_from_the_token_types(family):
    """Gemma 3 / Gemma 4: each image's tokens attend to each other both ways (Gemma 4: on its sliding-window
    layers), a mask the composite model builds from the token types and hands its language model. Every stage gets
    each row's token types (``mask_token_type_ids`` / ``mask_mm_token_type_ids``, padded with the rows) and builds
    that mask, so the two stages on each one-row micro-batch give the whole model's logits, on right- and
    left-padded rows (Gemma 4's images regrouped with their patch positions); the second stage building the plain
    causal mask (the types not reaching it) does not."""
    import torch
    from vlm_context_parallel_workers import gemma_micro_batches, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.pipeline import layout_issue, mask_kwargs, media_per_row

    model, _ = tiny_model(family)
    model.eval()
    assert layout_issue(model.config) is None
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)
    for left in (False, True):
        batch = gemma_micro_batches(family, 0, 4, left=left)[0]
        media = media_per_row(batch, model.config)
        assert media["pixel_values"][1].tolist() == [1, 1]
        kwargs = {**stage_kwargs(batch, 8), **media_kwargs(media), **mask_kwargs(batch, model.config, 8)}
        assert sorted(key for key in kwargs if key.startswith("mask_")) == \
            ["mask_token_type_ids" if family == "gemma3_pp" else "mask_mm_token_type_ids"]
        ids, _ = padded_tokens(batch, 8, 0)
        length = batch["input_ids"].shape[1]
        with torch.no_grad():
            whole = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
            for row in range(2):
                real = batch["attention_mask"][row].bool()
                row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
                later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
                logits = second(first(ids[row:row + 1], **row_kwargs), **later)[0, :length]
                assert torch.allclose(logits[real], whole[row][real], atol=1e-5), (left, row)
                causal = {key: value for key, value in later.items() if not key.startswith("mask_")}
                logits = second(first(ids[row:row + 1], **row_kwargs), **causal)[0, :length]
                assert not torch.allclose(logits[real], whole[row][real], atol=1e-3), (left, row)


def test_gemma4_images_of_different_sizes_are_counted_by_their_real_patches():
    """Gemma 4's images differ in size: each is padded to the batch's most patches (positions -1) and is its real
    patches over pooling_kernel_size**2 tokens, as the model splits its features; so the rows' images (two of 4 and
    2 tokens, none, one of 2) are found and regrouped with their positions, and the two stages on each one-row
    micro-batch give the whole model's logits."""
    import torch
    from vlm_context_parallel_workers import GEMMA_IMAGE, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.pipeline import mask_kwargs, media_per_row

    model, _ = tiny_model("gemma4_pp")
    model.eval()
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)

    def grid(height: int, width: int) -> torch.Tensor:  # a height x width patch image padded to 16 patches
        real = torch.stack(torch.meshgrid(torch.arange(width), torch.arange(height), indexing="xy"), -1)
        return torch.cat([real.reshape(-1, 2), torch.full((16 - height * width, 2), -1)])

    def image(tokens: int) -> list[int]:
        return [GEMMA_IMAGE + 1] + [GEMMA_IMAGE] * tokens + [GEMMA_IMAGE + 2]

    rows = [[1, 5, *image(4), 6, *image(2), 7, 8, 9], [1, 10, 11, 12, 13], [1, 14, *image(2), 15, 16]]
    ids, mask = torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row)], mask[index, :len(row)] = torch.tensor(row), 1
    batch = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == GEMMA_IMAGE).long(),
             "pixel_values": torch.rand(3, 16, 48, generator=torch.Generator().manual_seed(5)),
             "image_position_ids": torch.stack([grid(4, 4), grid(2, 4), grid(4, 2)])}
    media = media_per_row(batch, model.config)
    assert media["pixel_values"][1].tolist() == media["image_position_ids"][1].tolist() == [2, 0, 1]
    kwargs = {**stage_kwargs(batch, 8), **media_kwargs(media), **mask_kwargs(batch, model.config, 8)}
    tokens, _ = padded_tokens({**batch, "labels": ids}, 8, 0)
    with torch.no_grad():
        whole = model(**batch, use_cache=False).logits
        for row in range(3):
            row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
            later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
            logits = second(first(tokens[row:row + 1], **row_kwargs), **later)[0, :16]
            real = mask[row].bool()
            assert torch.allclose(logits[real], whole[row][real], atol=1e-5), row


def test_gemma4_per_layer_inputs_and_shared_keys_travel_from_the_stages_that_make_them():
    """A Gemma 4 as the E2B / E4B: per-layer inputs, and its last two layers (second stage) reusing the keys and
    values of layers 0 and 1 (first stage). The first stage alone holds the modules that make the per-layer inputs
    and sends the second stage's layers' slices, then each shared type's keys and values, beside the hidden states;
    the second stage runs its layers on them, so the two stages on each one-row micro-batch give the whole model's
    logits; zeros in place of either (what the second stage would lack without them) do not."""
    import torch
    from vlm_context_parallel_workers import gemma_micro_batches, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.gemma4_pipeline import travel_gemma4
    from automodel_vlm.pipeline import layout_issue, mask_kwargs, media_per_row

    model, _ = tiny_model("gemma4_small")
    model.eval()
    assert layout_issue(model.config) is None
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)
    makers = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
    assert all(getattr(first.model.language_model, name) is not None for name in makers)
    assert all(getattr(second.model.language_model, name) is None for name in makers)
    for stage in (first, second):
        assert travel_gemma4(stage) == (
            "pipeline: Gemma 4's per-layer inputs (8 values a position and layer) and the keys and values its layer "
            "1 stores for the full_attention layers 3-3 and the keys and values its layer 0 stores for the "
            "sliding_attention layers 2-2 travel beside the hidden states to the stages whose layers take them")
    batch = gemma_micro_batches("gemma4_small", 0, 4, left=True)[0]
    kwargs = {**stage_kwargs(batch, 8), **media_kwargs(media_per_row(batch, model.config)),
              **mask_kwargs(batch, model.config, 8)}
    ids, _ = padded_tokens(batch, 8, 0)
    length = batch["input_ids"].shape[1]
    with torch.no_grad():
        whole = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
        for row in range(2):
            real = batch["attention_mask"][row].bool()
            row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
            later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
            hidden, *beside = first(ids[row:row + 1], **row_kwargs)
            # layers 2 and 3's inputs; full attention's keys and values (one head of 16), then sliding's
            assert [tuple(part.shape) for part in beside] == [(1, length + 8, 8)] * 2 + [(1, length + 8, 16)] * 4
            logits = second(hidden, *beside, **later)[0, :length]
            assert torch.allclose(logits[real], whole[row][real], atol=1e-5), row
            for lost in (slice(0, 2), slice(2, 6)):
                parts = [torch.zeros_like(part) if n in range(6)[lost] else part for n, part in enumerate(beside)]
                logits = second(hidden, *parts, **later)[0, :length]
                assert not torch.allclose(logits[real], whole[row][real], atol=1e-3), (row, lost)


@pytest.mark.parametrize("family", ["paligemma", "paligemma2"])
def test_paligemma_stages_number_the_positions_from_1_and_build_its_prefix_mask(family):
    """PaliGemma (and PaliGemma 2: a Gemma 2 language model, sliding-window layers): its forward numbers the
    positions from 1 and lets the prefix (image and prompt tokens, token_type_ids 0) attend to itself both ways.
    The pipeline hands every stage those positions and the token types, from which the later stages build the
    model's masks, so the two stages on each one-row micro-batch give the whole model's logits, on right- and
    left-padded rows; the second stage building the plain causal mask does not."""
    import torch
    from vlm_context_parallel_workers import gemma_micro_batches, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.pipeline import layout_issue, mask_kwargs, media_per_row, rope_positions

    model, _ = tiny_model(family)
    model.train()  # as training runs it (PaliGemma's forward reads the token types then)
    atol = 1e-4 if family == "paligemma2" else 1e-5  # Gemma 2's eager attention: one row vs the padded batch
    assert layout_issue(model.config) is None
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)
    for left in (False, True):
        batch = gemma_micro_batches(family, 0, 4, left=left)[0]
        pipelined = rope_positions(batch, model.config, None)
        assert pipelined["position_ids"][:, :3].tolist() == [[1, 2, 3]] * 2
        kwargs = {**stage_kwargs(pipelined, 8), **media_kwargs(media_per_row(pipelined, model.config)),
                  **mask_kwargs(pipelined, model.config, 8)}
        ids, _ = padded_tokens(pipelined, 8, 0)
        length = batch["input_ids"].shape[1]
        with torch.no_grad():
            whole = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
            for row in range(2):
                real = batch["attention_mask"][row].bool()
                row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
                later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
                logits = second(first(ids[row:row + 1], **row_kwargs), **later)[0, :length]
                assert torch.allclose(logits[real], whole[row][real], atol=atol), (left, row)
                causal = {key: value for key, value in later.items() if not key.startswith("mask_")}
                logits = second(first(ids[row:row + 1], **row_kwargs), **causal)[0, :length]
                assert not torch.allclose(logits[real], whole[row][real], atol=1e-3), (left, row)


@pytest.mark.slow
def test_gemma_pp2_trains_like_one_process_and_not_with_causal_later_stages(tmp_path):
    """Two steps (right-padded rows, then left-padded ones) of a tiny Gemma 3, a tiny Gemma 4 and a tiny Gemma 4
    with per-layer inputs (those of the second stage's layers travelling from the first; with static stage shapes
    too) cut in two stages on two gloo ranks, 1F1B over one-row micro-batches through the recipe's
    pipeline_batches: the losses and gradient norms of one process; with the second stage building the causal mask
    instead (the token types ignored) they differ."""
    from parallel_testing import launch_together

    one, pp2 = launch_together([("vlm_pp_gemma", 0, tmp_path / "one", {}), ("vlm_pp_gemma", 2, tmp_path / "pp2", {})],
                               workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=300)
    for family in ("gemma3_pp", "gemma4_pp", "paligemma", "gemma4_small", "gemma4_small_static"):
        reference = one[0][family.removesuffix("_static")]
        for rank in pp2:
            assert rank[family]["losses"] == pytest.approx(reference["losses"], rel=1e-5), family
            assert rank[family]["norms"] == pytest.approx(reference["norms"], rel=1e-5), family
            if family in ("gemma3_pp", "gemma4_pp", "paligemma"):  # PaliGemma's prefix: a smaller effect
                causal = rank[f"{family}_causal"]
                assert causal["losses"] != pytest.approx(reference["losses"], rel=1e-5), family
                assert causal["norms"] != pytest.approx(reference["norms"], rel=1e-5), family


@pytest.mark.slow  # make test-slow: the same path as a faster test of this suite
def test_gemma_pp2_x_cp2_trains_like_one_process_and_not_without_the_image_spans(tmp_path):
    """pp 2 x cp 2 on four gloo ranks: the two steps of a tiny Gemma 3, Gemma 4, PaliGemma and Gemma 4 with
    per-layer inputs and shared keys and values (with static stage shapes too), each stage's layers on the rank's
    part of the rows
    with the all-gather attention, whose mask lets each image's tokens attend to each other both ways (from the
    rows' token types, as cp alone): the losses and gradient norms of one process on the same rows; without the
    spans in the mask (causal over the images) they differ."""
    from parallel_testing import launch_together

    one, ranks = launch_together([("vlm_pp_gemma", 0, tmp_path / "one", {"pad_to": 4}),
                                  ("vlm_pp_gemma", 4, tmp_path / "pp2cp2", {})],
                                 workers=Path(__file__).with_name("vlm_context_parallel_workers.py"), timeout=300)
    for family in ("gemma3_pp", "gemma4_pp", "paligemma", "gemma4_small", "gemma4_small_static"):
        reference = one[0][family.removesuffix("_static")]
        for rank in ranks:
            assert rank[family]["losses"] == pytest.approx(reference["losses"], rel=1e-5), family
            assert rank[family]["norms"] == pytest.approx(reference["norms"], rel=1e-5), family
            if family in ("gemma3_pp", "gemma4_pp", "paligemma"):
                causal = rank[f"{family}_causal"]
                assert causal["losses"] != pytest.approx(reference["losses"], rel=1e-5), family


def test_no_gemma_layout_is_refused_by_the_pipeline():
    """PaliGemma (its 1-based positions handed to every stage, its prefix mask built from the token types), a
    Gemma 4 with per-layer inputs and shared keys and values (they travel), a Gemma under pp x cp (the stages'
    all-gather attention takes the image spans): none is refused; a model without a media layout still is."""
    from types import SimpleNamespace

    from transformers import Gemma3Config, Gemma4Config, LlavaNextConfig, PaliGemmaConfig

    from automodel_vlm.pipeline import layout_issue, pipeline_issues

    small = Gemma4Config(text_config={"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2})
    assert layout_issue(PaliGemmaConfig()) is None and layout_issue(small) is None
    pp_cp = SimpleNamespace(distributed=SimpleNamespace(pp_size=2, cp_size=2))
    assert pipeline_issues(pp_cp, Gemma3Config()) == pipeline_issues(pp_cp, PaliGemmaConfig()) == []
    (issue,) = pipeline_issues(pp_cp, LlavaNextConfig())
    assert issue.key == "distributed.pp_size" and "the model (llava_next) has no media layout here" in str(issue)


def test_a_gemma3_under_pp_and_cp_is_refused_by_validate_only_with_ring_attention(tmp_path):
    """Its media layout is known (no pp_size issue) and the stages' all-gather attention takes the two-way image
    spans its token types give; torch's ring attention, causal only (and CUDA's), is refused."""
    gemma3 = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 2, "tie_word_embeddings": False},
              "tie_word_embeddings": False}
    out = _validate(tmp_path, "--nproc-per-node", "4", model={"config": gemma3}, eval_generation=None,
                    distributed={"strategy": "fsdp2", "pp_size": 2, "cp_size": 2, "cp_attention": "ring"})
    assert "distributed.cp_attention: ring with pp_size 2" in out
    assert "distributed.pp_size" not in out and "masks from its token types" not in out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_stages_run_one_row_micro_batches_like_the_whole_model(family):
    """The Qwen2-VL's media layout (Qwen2.5-VL's too: its windowed vision tower, the same rope): each row's images
    (of different sizes: their patches and grids) regrouped per row, its 3-D rope positions computed on the whole
    rows (packed rows: the collator's, with their text row) and handed to both stages rows first; the two stages on
    each one-row micro-batch give the whole model's logits on the batch, right-padded and packed (the second stage
    without the positions does not). pp 2 x cp 2 on four ranks (Qwen2-VL): test_context_parallel.py."""
    import torch
    from vlm_context_parallel_workers import micro_batches, tiny_model

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.datasets.packing import rope_index
    from automodel_vlm.pipeline import media_per_row, rope_positions

    model, processor = tiny_model(family)
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)
    padded, packed = micro_batches(processor, 1, 4)[0], micro_batches(processor, 1, 4, rope_index(model))[0]
    assert padded["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]  # 16 and 24 patches, 4 and 6 image tokens
    for batch, axes in ((padded, 3), (packed, 4)):  # packed rows: the text positions on top of the three axes
        pipelined = rope_positions(batch, model.config, rope_index(model))
        assert pipelined["position_ids"].shape == (2, axes, batch["input_ids"].shape[1])
        assert "mm_token_type_ids" not in pipelined
        kwargs = {**stage_kwargs(pipelined, 8), **media_kwargs(media_per_row(pipelined, model.config))}
        ids, _ = padded_tokens(pipelined, 8, 0)
        length = batch["input_ids"].shape[1]
        with torch.no_grad():
            inputs = {key: value for key, value in batch.items() if key not in ("labels", "token_count")}
            whole = model(**inputs, use_cache=False).logits  # as training runs it (a cache hides the packing)
            for row in range(2):
                row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
                later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
                logits = second(first(ids[row:row + 1], **row_kwargs), **later)
                assert torch.allclose(logits[:, :length], whole[row:row + 1], atol=1e-5)
                later.pop("position_ids")
                logits = second(first(ids[row:row + 1], **row_kwargs), **later)
                assert not torch.allclose(logits[:, :length], whole[row:row + 1], atol=1e-5)


def test_dry_run_prints_the_vision_tower_on_the_first_stage(tmp_path):
    config = write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", eval_generation=None)
    result = run_cli_inprocess("finetune", "vlm", "-c", config, *PP2, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "pp rank 0: stage 0 (vision tower + projector + embedding + layers 0-0)" in out
    assert "pp rank 1: stage 1 (layers 1-1 + norm, head)" in out


def _tiny_mistral3() -> tuple[Any, dict[str, Any]]:
    """A tiny Mistral 3 (Pixtral tower of 4-pixel patches, merged 2 x 2: an image of h x w pixels is h / 8 x w / 8
    [IMG] tokens) and a batch as the Pixtral processor makes one: each image a grid of [IMG] tokens, each grid row
    closed by [IMG_BREAK], the last by [IMG_END]; the pixels padded to the largest image, ``image_sizes`` each
    image's own. Rows of two images (16 x 16, then 24 x 16), none, one (16 x 24)."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    image, image_break, image_end, vocab = 10, 11, 12, 48
    config = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": vocab,
                     "tie_word_embeddings": False},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 24, "patch_size": 4},
        image_token_index=image, spatial_merge_size=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).eval()

    def grid(height: int, width: int) -> list[int]:
        tokens = ([image] * (width // 8) + [image_break]) * (height // 8)
        return tokens[:-1] + [image_end]

    sizes = [(16, 16), (24, 16), (16, 24)]
    rows = [[1, 20, *grid(*sizes[0]), 21, *grid(*sizes[1]), 22, 23], [1, 24, 25, 26],
            [1, 27, *grid(*sizes[2]), 28, 29]]
    width = max(len(row) for row in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row)], mask[index, :len(row)] = torch.tensor(row), 1
    pixels = torch.zeros(len(sizes), 3, 24, 24)
    for index, (height, width_) in enumerate(sizes):
        pixels[index, :, :height, :width_] = torch.randn(3, height, width_)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
                   "pixel_values": pixels, "image_sizes": torch.tensor(sizes)}


def test_mistral3_stages_run_one_row_micro_batches_like_the_whole_model():
    """Mistral 3's media layout: each image's [IMG] tokens follow its own size (image_sizes), so the rows' images
    (two, none, one) are found by their sizes and regrouped per row with them; the two stages on each one-row
    micro-batch give the whole model's logits (not with the first row's image sizes swapped: the Pixtral tower and
    the patch merger read each image's own size)."""
    import torch

    from automodel.training.parallel.pipeline_media import media_kwargs
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.pipeline_steps import padded_tokens, stage_kwargs
    from automodel_vlm.pipeline import media_per_row

    model, batch = _tiny_mistral3()
    (first,), (second,) = split_model(model, 0, 2), split_model(model, 1, 2)
    media = media_per_row(batch, model.config)
    assert media["image_sizes"][1].tolist() == [2, 0, 1] and media["pixel_values"][1].tolist() == [2, 0, 1]
    kwargs = {**stage_kwargs(batch, 8), **media_kwargs(media)}
    ids, _ = padded_tokens(batch, 8, 0)
    length = batch["input_ids"].shape[1]
    with torch.no_grad():
        whole = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
        for row in range(3):
            row_kwargs = {key: value[row:row + 1] for key, value in kwargs.items()}
            later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
            logits = second(first(ids[row:row + 1], **row_kwargs), **later)
            assert torch.allclose(logits[:, :length], whole[row:row + 1], atol=1e-5), row
        row_kwargs = {key: value[:1] for key, value in kwargs.items()}
        row_kwargs["media_image_sizes"] = row_kwargs["media_image_sizes"].flip(1)  # each image another's size
        later = {key: value for key, value in row_kwargs.items() if not key.startswith("media_")}
        assert not torch.allclose(second(first(ids[:1], **row_kwargs), **later)[:, :length], whole[:1], atol=1e-5)
