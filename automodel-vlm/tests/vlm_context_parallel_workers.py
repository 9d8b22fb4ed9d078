"""The VLM recipe's context-parallel step (``TrainingLoop._train_step`` with ``sequence_parts``) on CPU gloo ranks,
against one process, for a tiny Llava (CLIP + Llama) and a tiny Qwen2-VL (multi-axis rope positions; pictures of
three sizes), with the all-gather attention (``distributed.cp_attention: all_gather``; torch's ring attention has no
CPU kernel), on right-padded rows and on packed rows (two conversations a row, told apart by their text positions);
on cp ranks the Qwen2-VL once more with its vision tower's frames split over them (``frame_sharding``), and a tiny
Qwen3-VL vision tower split by frames (a video's among them) against whole; and for a tiny Gemma 3 (each image's
tokens attend to each other both ways, a sliding-window layer) and a tiny Gemma 4 (the same on its sliding-window
layers only; per-layer inputs; layers sharing keys and values) on right-padded, then left-padded rows, once more on
the cp ranks without the image spans in the mask (which must not match).

Everything is the recipe's and the core's: the micro-batch collated by ``VLMCollator`` (or ``PackedVLMCollator``)
padded to a multiple of 2 x cp, the vision tower (or its frame sharding) and the merge on every rank, the language
model's pre-hook splitting the merged embeddings and positions, the region splitting the targets, the routing of the
vision tower's attention (not causal) to SDPA's own kernel, the gathered keys and values with their mask, the loss,
its scale and FSDP2 over ``cp``.

Run as ``python vlm_context_parallel_workers.py <scenario> <json args> <result file>`` (``parallel_testing``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "automodel-core" / "tests"))  # the core's workers
from parallel_workers import full_state, main  # noqa: E402

from automodel.training.loss import IGNORE_INDEX, MaskedCrossEntropy
from automodel.training.next_token import HeadOnPositions
from automodel.training.parallel.context_parallel import causal_attention_without_mask, fsdp_mesh
from automodel.training.parallel.fsdp import apply_fsdp2
from automodel.training.parallel.mesh import CP, MeshLayout, build_device_mesh, plan_mesh
from automodel.training.parallel.multimodal_fsdp import place_multimodal
from automodel.training.parallel.precision import Precision
from automodel_vlm.context_parallel import SequenceSplit, causal_prefix_attention
from automodel_vlm.datasets.collate import VLMCollator
from automodel_vlm.datasets.packing import PackedVLMCollator, rope_index
from automodel_vlm.frame_sharding import FrameSharding
from automodel_vlm.parts import MULTIMODAL_NAMES, find_part
from automodel_vlm.recipe import FinetuneRecipeForVLM

MICRO_BATCHES, ROWS = 2, 2
GEMMA_VOCAB, GEMMA_IMAGE, GEMMA_IMAGE_TOKENS = 64, 60, 4
COLORS = ["red", "green", "blue", "yellow"]
SIZES = [(32, 32), (32, 48), (48, 64)]  # Qwen2-VL: 16, 24 and 48 patch rows, 4, 6 and 12 merged tokens


class Step(FinetuneRecipeForVLM):
    """The VLM recipe's loss, its context-parallel batch and the loop's step; the rest set up by hand."""

    def __init__(self, model: torch.nn.Module, processor: Any, layout: MeshLayout, device_mesh: Any,
                 frames: dict[str, Any] | None = None):
        self.model, self.processor = model, processor
        self.ctx = SimpleNamespace(mesh=layout, device_mesh=device_mesh, precision=Precision(),
                                   fsdp2=device_mesh is not None, device=torch.device("cpu"),
                                   world_size=layout.world_size)
        self.cfg = SimpleNamespace(distributed=SimpleNamespace(cp_size=layout.cp, cp_attention="all_gather",
                                                               defer_fsdp_grad_sync=True), model=None,
                                   clip_grad_norm=SimpleNamespace(max_norm=None, norm_type=2.0),
                                   logits=SimpleNamespace(label_positions_only=True))
        self.head_positions = HeadOnPositions.attach(model)
        self.grad_scaler = self.pipelines = self.lr_scheduler = self.mtp_heads = self.loss_head = None
        self.trainable_params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.trainable_params, lr=1e-3)
        self.loss_fn = MaskedCrossEntropy()
        if layout.cp > 1:
            self.sequence_split = SequenceSplit(find_part(model, "language_model")[1], device_mesh[CP])
            causal_prefix_attention(model)  # as the recipe's setup does (PaliGemma's layers)
        if frames is not None:
            self.frame_sharding = FrameSharding(vision_tower(model), device_mesh[CP], frames)


def tiny_model(family: str) -> tuple[torch.nn.Module, Any]:
    """The family's tiny model (fp32, SDPA) and processor (None for Gemma 3, whose batches are built by hand), the
    same weights on every rank."""
    import json

    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3Config, Gemma4Config, PaliGemmaConfig
    from vlm_testing import LLAVA_CONFIG, tiny_processor, tiny_qwen_vl_processor

    if family.startswith("gemma3"):  # gemma3_pp: four layers (each stage's attention over the images matters to
        processor = None  # the loss), its head apart from its embedding, as the pipeline needs
        tied, layers = family != "gemma3_pp", (2 if family == "gemma3" else 4)
        config = Gemma3Config(
            text_config={"hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32, "vocab_size": GEMMA_VOCAB,
                         "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
                         "tie_word_embeddings": tied},
            tie_word_embeddings=tied,
            vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
            mm_tokens_per_image=GEMMA_IMAGE_TOKENS, image_token_index=GEMMA_IMAGE, boi_token_index=GEMMA_IMAGE + 1,
            eoi_token_index=GEMMA_IMAGE + 2)
    elif family.startswith("gemma4"):  # images two-way on the sliding layers, per-layer inputs, the last two
        processor = None  # layers' keys and values those of the first two (gemma4_pp: neither, as the 31B;
        pipelined = family in ("gemma4_pp", "gemma4_small")  # gemma4_small: both, as the E2B, its head apart)
        per_layer, shared = (0, 0) if family == "gemma4_pp" else (8, 2)
        config = Gemma4Config(
            text_config={"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16, "intermediate_size": 32,
                         "vocab_size": GEMMA_VOCAB, "vocab_size_per_layer_input": GEMMA_VOCAB,
                         "hidden_size_per_layer_input": per_layer, "sliding_window": 6,
                         "num_kv_shared_layers": shared, "tie_word_embeddings": not pipelined,
                         "layer_types": ["sliding_attention", "full_attention"] * 2,
                         "use_bidirectional_attention": "vision"},
            vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
                           "pooling_kernel_size": 2, "position_embedding_size": 64},
            audio_config=None, image_token_id=GEMMA_IMAGE, boi_token_id=GEMMA_IMAGE + 1,
            eoi_token_id=GEMMA_IMAGE + 2, video_token_id=GEMMA_IMAGE + 3, audio_token_id=GEMMA_IMAGE - 1,
            boa_token_id=GEMMA_IMAGE - 2, eoa_token_index=GEMMA_IMAGE - 3, tie_word_embeddings=not pipelined)
    elif family.startswith("paligemma"):  # paligemma2: a Gemma 2 language model (sliding-window layers, eager)
        processor = None
        text = {"model_type": "gemma2" if family == "paligemma2" else "gemma", "hidden_size": 32,
                "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                "intermediate_size": 32, "vocab_size": GEMMA_VOCAB, "tie_word_embeddings": False}
        if family == "paligemma2":
            text |= {"sliding_window": 6}
        config = PaliGemmaConfig(
            text_config=text, vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                             "num_attention_heads": 2, "image_size": 8, "patch_size": 4,
                                             "projection_dim": 32},
            image_token_index=GEMMA_IMAGE, projection_dim=32, tie_word_embeddings=False)
        config.text_config.num_image_tokens = GEMMA_IMAGE_TOKENS
        torch.manual_seed(0)
        attention = "eager" if family == "paligemma2" else "sdpa"  # transformers' Gemma 2: no SDPA
        config._attn_implementation = attention
        return AutoModelForImageTextToText.from_config(config, attn_implementation=attention), processor
    elif family == "llava":
        processor = tiny_processor()
        config = AutoConfig.for_model(**json.loads(LLAVA_CONFIG.read_text()))
    elif family.startswith(("qwen3_vl", "qwen3_5")):
        processor, config = tiny_qwen3_config(family)
    else:  # Qwen2-VL, or Qwen2.5-VL (the same processor and rope; a windowed vision tower with its own MLP)
        from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

        processor = tiny_qwen_vl_processor(max_pixels=64 * 64)
        tokenizer = processor.tokenizer
        vision = {"depth": 2, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2}
        if family == "qwen2_5_vl":  # windows of 2 x 2 merged tokens, the second block attending over the whole image
            vision |= {"hidden_size": 16, "intermediate_size": 32, "out_hidden_size": 32, "window_size": 32,
                       "fullatt_block_indexes": [1]}
        else:
            vision |= {"embed_dim": 16, "hidden_size": 32}
        config = (Qwen2_5_VLConfig if family == "qwen2_5_vl" else Qwen2VLConfig)(
            text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": len(tokenizer),
                         "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
            vision_config=vision, image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa"), processor


def tiny_qwen3_config(family: str) -> tuple[Any, Any]:
    """The Qwen2-VL processor and a tiny config of Qwen3-VL (4 layers, the first 3 adding a DeepStack map each) or
    Qwen3.5 (2 layers: linear attention, then full), dense or MoE (``*_moe``: 4 experts, 2 a token)."""
    from transformers import AutoConfig
    from vlm_testing import tiny_qwen_vl_processor

    processor = tiny_qwen_vl_processor(max_pixels=64 * 64)
    tokenizer = processor.tokenizer
    base = family.removesuffix("_moe")
    text = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "intermediate_size": 32, "vocab_size": len(tokenizer), "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    vision = {"depth": 3, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 8,
              "out_hidden_size": 32, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if base == "qwen3_vl":
        text |= {"num_hidden_layers": 4}
        vision |= {"deepstack_visual_indexes": [0, 1, 2], "num_position_embeddings": 64}
    else:
        text |= {"num_hidden_layers": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                 "linear_key_head_dim": 8, "linear_value_head_dim": 8, "full_attention_interval": 2,
                 "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
        text["rope_parameters"] |= {"partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
    if family.endswith("_moe"):
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                 "shared_expert_intermediate_size": 16}
    config = AutoConfig.for_model(
        family, text_config=text, vision_config=vision,
        image_token_id=processor.image_token_id, video_token_id=processor.video_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"), tie_word_embeddings=False)
    return processor, config


def micro_batches(processor: Any, step: int, pad_to: int, rope: Any = False) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batches: picture conversations of different lengths, images of random pixels, collated as the
    recipe collates them: right-padded rows, or (``rope`` given: the model's ``rope_index``, None for a model
    without one) packed rows of two conversations each, padded to a multiple of ``pad_to``."""
    from vlm_testing import conversation

    generator = torch.Generator().manual_seed(100 + step)
    collator = VLMCollator(processor, pad_to_multiple_of=pad_to)
    batches = []
    for _ in range(MICRO_BATCHES):
        samples = []
        for _ in range(ROWS * (1 if rope is False else 2)):
            size = SIZES[int(torch.randint(0, len(SIZES), (1,), generator=generator))]
            pixels = torch.randint(0, 256, (*size, 3), generator=generator, dtype=torch.uint8).numpy()
            words = int(torch.randint(1, 4, (1,), generator=generator))
            answer = " ".join(COLORS[int(torch.randint(0, 4, (1,), generator=generator))] for _ in range(words))
            samples.append({"messages": conversation("What colors?", answer), "images": [Image.fromarray(pixels)]})
        if rope is False:
            batches.append(collator(samples))
            continue
        rows = [samples[i:i + 2] for i in range(0, len(samples), 2)]
        longest = max(sum(collator([one])["input_ids"].shape[1] for one in row) for row in rows)
        batches.append(PackedVLMCollator(collator, -(-longest // pad_to) * pad_to, rope)(rows))
    return batches


def gemma_micro_batches(family: str, step: int, pad_to: int, left: bool) -> list[dict[str, torch.Tensor]]:
    """A step's Gemma 3 / 4 micro-batches as their processors make them: per row a few text tokens, the image
    (begin, four image tokens marked by ``token_type_ids`` / ``mm_token_type_ids``, end), a question and an answer
    (the labels), padded to a multiple of ``pad_to`` on the right, or on the ``left``; Gemma 4's images as 4 x 4
    patches with their grid positions. PaliGemma's: the four image tokens, then the prompt (``token_type_ids`` 0),
    then the answer (1)."""
    generator = torch.Generator().manual_seed(200 + step)

    def text(count: int) -> list[int]:
        return torch.randint(2, GEMMA_IMAGE, (count,), generator=generator).tolist()

    batches = []
    for _ in range(MICRO_BATCHES):
        rows, answers = [], []
        for _ in range(ROWS):
            lengths = torch.randint(1, 5, (3,), generator=generator).tolist()
            image = [GEMMA_IMAGE + 1] + [GEMMA_IMAGE] * GEMMA_IMAGE_TOKENS + [GEMMA_IMAGE + 2]
            if family.startswith("paligemma"):  # its processor's prefix: the image tokens, then the prompt
                rows.append([GEMMA_IMAGE] * GEMMA_IMAGE_TOKENS + [1, *text(lengths[0] + lengths[1])])
            else:
                rows.append([1, *text(lengths[0]), *image, *text(lengths[1])])
            answers.append(text(lengths[2] + 1))
        width = -(-max(len(r) + len(a) for r, a in zip(rows, answers, strict=True)) // pad_to) * pad_to
        ids, labels, mask = (torch.zeros(ROWS, width, dtype=torch.long) for _ in range(3))
        labels.fill_(IGNORE_INDEX)
        for row, (prompt, answer) in enumerate(zip(rows, answers, strict=True)):
            length = len(prompt) + len(answer)
            place = slice(width - length, width) if left else slice(0, length)
            ids[row, place] = torch.tensor(prompt + answer)
            labels[row, place] = torch.tensor([IGNORE_INDEX] * len(prompt) + answer)
            mask[row, place] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if family.startswith("paligemma"):  # the prefix 0, the answer (the suffix) 1
            batch |= {"token_type_ids": (labels != IGNORE_INDEX).long(),
                      "pixel_values": torch.randn(ROWS, 3, 8, 8, generator=generator)}
        elif family.startswith("gemma3"):
            batch |= {"token_type_ids": (ids == GEMMA_IMAGE).long(),
                      "pixel_values": torch.randn(ROWS, 3, 16, 16, generator=generator)}
        else:
            grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(16, 2)
            batch |= {"mm_token_type_ids": (ids == GEMMA_IMAGE).long(), "image_position_ids": grid.expand(ROWS, 16, 2),
                      "pixel_values": torch.rand(ROWS, 16, 3 * 16, generator=generator)}
        batches.append(batch)
    return batches


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    return find_part(model, "vision_tower")[1]


def run(family: str, layout: MeshLayout, frames: dict[str, Any] | None = None, pad_to: int = 2) -> dict[str, Any]:
    """Two steps: losses, gradient norms, the vision tower's gradients of the first step, the weights and the
    grids the vision tower ran on (``frames``: frame sharding's settings)."""
    model, processor = tiny_model(family)
    device_mesh, hooked = None, 0
    if layout.world_size > 1:
        device_mesh = build_device_mesh(layout, "cpu")
        hooked = causal_attention_without_mask(model, [vision_tower(model)])
        apply_fsdp2(model, fsdp_mesh(device_mesh, layout),
                    multimodal=place_multimodal(model, MULTIMODAL_NAMES, "root"))  # as the sharding stage does
    step = Step(model, processor, layout, device_mesh, frames)
    grids: list[list] = []  # after frame sharding's hook: the frames this rank ran
    vision_tower(model).register_forward_pre_hook(
        lambda _, args, kwargs: grids.append(kwargs["grid_thw"].tolist()) if "grid_thw" in kwargs else None,
        with_kwargs=True)
    grads: dict[str, list] = {}
    update = step.optimizer.step

    def record_then_update() -> None:
        if not grads:
            for name, param in vision_tower(model).named_parameters():
                if param.grad is not None:  # the layers after the one whose features are taken have none
                    grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                    grads[name] = grad.tolist()
        update()

    step.optimizer.step = record_then_update
    if family.startswith(("gemma", "paligemma")):  # right-padded rows, then left-padded ones
        batches = [gemma_micro_batches(family, s, pad_to * layout.cp, s == 1) for s in range(2)]
    else:  # right-padded rows, then packed rows (samples kept apart within a row)
        batches = [micro_batches(processor, 0, 2 * layout.cp), micro_batches(processor, 1, 2 * layout.cp,
                                                                             rope_index(model))]
    results = [step._train_step(b) for b in batches]
    return {"losses": [loss.item() for loss, _, _ in results], "norms": [norm.item() for _, norm, _ in results],
            "vision_grads": grads, "state": {k: v.tolist() for k, v in full_state(model).items()},
            "length": batches[0][0]["input_ids"].shape[1], "hooked": hooked, "grids": grids}


def run_pipelined(family: str, layout: MeshLayout) -> dict[str, Any]:
    """The first step of :func:`run` (right-padded rows) as the engine runs it pipelined: the model cut in two stages
    (``pp`` rank 0: vision tower, merger, embedding, layer 0), the attention of each stage's layers gathered over
    its ``cp`` group, FSDP2 over ``cp``, the recipe's ``pipeline_batches`` (media per row, the 3-D rope positions
    rows first) through 1F1B with one-row micro-batches: the loss, the gradient norm and the vision tower's
    gradients (``pp`` rank 0)."""
    from automodel.training.parallel.mesh import PP
    from automodel.training.parallel.multimodal_fsdp import multimodal_modules
    from automodel.training.parallel.pipeline_parallel import PipelineSettings, StagePipelines
    from automodel.training.parallel.pipeline_stages import split_model

    model, processor = tiny_model(family)
    device_mesh = build_device_mesh(layout, "cpu")
    (stage,) = split_model(model, device_mesh[PP].get_local_rank(), layout.pp)
    causal_attention_without_mask(stage, multimodal_modules(stage, MULTIMODAL_NAMES).values())
    apply_fsdp2(stage, fsdp_mesh(device_mesh, layout), multimodal=place_multimodal(stage, MULTIMODAL_NAMES, "root"))
    step = Step(stage, processor, layout, device_mesh)
    step.pipelines = StagePipelines([stage], device_mesh[PP], torch.device("cpu"), PipelineSettings(),
                                    step.pipeline_loss, cp_mesh=device_mesh[CP])
    grads: dict[str, list] = {}
    update = step.optimizer.step

    def record_then_update() -> None:
        tower = find_part(stage, "vision_tower")
        for name, param in tower[1].named_parameters() if tower is not None else ():
            if param.grad is not None:
                grads[name] = param.grad.full_tensor().tolist()
        update()

    step.optimizer.step = record_then_update
    loss, norm, _ = step._train_step(micro_batches(processor, 0, 2 * layout.cp))
    return {"loss": loss.item(), "norm": norm.item(), "vision_grads": grads}


def run_gemma_pipelined(family: str, layout: MeshLayout, static: bool = False, pad_to: int = 2) -> dict[str, Any]:
    """The two steps of :func:`run` (right-padded rows, then left-padded ones) for a tiny Gemma 3 / Gemma 4 cut in
    two stages (``pp`` rank 0: vision tower, projector, embedding, the first layers), through 1F1B with one-row
    micro-batches and the recipe's ``pipeline_batches`` (each row's image and its token types, from which every
    stage builds the masks), a Gemma 4's per-layer inputs and shared keys and values travelling as the recipe sets
    them up (``static``: the stages with static shapes, ``pp_seq_len`` 32); under ``cp`` the layers' attention
    gathered over the rank's cp group, its mask taking the image spans (rows padded to a multiple of ``pad_to``):
    the losses and gradient norms."""
    from automodel.training.parallel.mesh import PP
    from automodel.training.parallel.multimodal_fsdp import multimodal_modules
    from automodel.training.parallel.pipeline_parallel import PipelineSettings, StagePipelines
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.parallel.pipeline_static import StaticShapes
    from automodel_vlm.context_parallel import two_way_stages
    from automodel_vlm.gemma4_pipeline import travel_gemma4

    model, _ = tiny_model(family)
    device_mesh = build_device_mesh(layout, "cpu")
    (stage,) = split_model(model, device_mesh[PP].get_local_rank(), layout.pp)
    if layout.cp > 1:
        causal_attention_without_mask(stage, multimodal_modules(stage, MULTIMODAL_NAMES).values())
    apply_fsdp2(stage, fsdp_mesh(device_mesh, layout), multimodal=place_multimodal(stage, MULTIMODAL_NAMES, "root"))
    line = travel_gemma4(stage)  # as the recipe does, on the built stage
    assert (line is None) == (family != "gemma4_small"), line
    if layout.cp > 1:
        two_way_stages(stage)
    tokenizer = SimpleNamespace(pad_token_id=0)
    step = Step(stage, SimpleNamespace(tokenizer=tokenizer), layout, device_mesh)
    text = model.config.text_config
    shapes = StaticShapes(32, text.hidden_size, text.vocab_size, torch.float32, torch.float32,
                          cp=layout.cp) if static else None
    step.pipelines = StagePipelines([stage], device_mesh[PP], torch.device("cpu"), PipelineSettings(),
                                    step.pipeline_loss, shapes, cp_mesh=device_mesh[CP] if layout.cp > 1 else None)
    results = [step._train_step(gemma_micro_batches(family, s, pad_to, s == 1)) for s in range(2)]
    return {"losses": [loss.item() for loss, _, _ in results], "norms": [norm.item() for _, norm, _ in results]}


GEMMA_PP = ("gemma3_pp", "gemma4_pp", "paligemma")


def scenario_vlm_pp_gemma(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """pp 2 on two ranks (:func:`run_gemma_pipelined`; a Gemma 4 with per-layer inputs with static shapes too),
    once more with the later stage's masks causal (the token types not reaching it); pp 2 x cp 2 on four ranks
    (rows padded to a multiple of 4), once more without the image spans in the cp attention's mask; or the
    one-process reference (:func:`run`; ``pad_to`` in ``args``) without a process group."""
    pad_to = args.get("pad_to", 2)
    if not dist.is_initialized():
        return {family: run(family, MeshLayout(1), pad_to=pad_to) for family in (*GEMMA_PP, "gemma4_small")}
    from automodel.training.parallel.pipeline_stages import PipelineStageModel

    if dist.get_world_size() == 4:  # pp 2 x cp 2
        layout = plan_mesh(4, pp_size=2, cp_size=2)
        gemma = GEMMA_PP
        results = {family: run_gemma_pipelined(family, layout, pad_to=4) for family in (*gemma, "gemma4_small")}
        results["gemma4_small_static"] = run_gemma_pipelined("gemma4_small", layout, static=True, pad_to=4)
        PipelineStageModel.spans_of = property(lambda self: lambda types: None, lambda self, value: None)
        return results | {f"{family}_causal": run_gemma_pipelined(family, layout, pad_to=4) for family in gemma}
    layout = plan_mesh(dist.get_world_size(), pp_size=dist.get_world_size())
    results = {family: run_gemma_pipelined(family, layout) for family in (*GEMMA_PP, "gemma4_small")}
    results["gemma4_small_static"] = run_gemma_pipelined("gemma4_small", layout, static=True)
    PipelineStageModel._model_masks = lambda self, hidden, attention_mask, position_ids, types: attention_mask
    return results | {f"{family}_causal": run_gemma_pipelined(family, layout) for family in GEMMA_PP}


def text_first_micro_batches(processor: Any) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of a row without an image, then one with (a 32 x 48 picture), right-padded: the pipeline's
    first micro-batch (one row), from which torch's stages learn what they exchange, has no image features."""
    from vlm_testing import conversation

    generator = torch.Generator().manual_seed(300)
    pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say red."}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": []}
    image = {"messages": conversation("What colors?", "green blue"), "images": [Image.fromarray(pixels)]}
    collator = VLMCollator(processor, pad_to_multiple_of=8)
    return [collator([text, image]), collator([text, image])]


MTP = {"depths": 2, "scaling_factor": 0.3}  # the Qwen3.5 MTP scenario's heads: two tokens ahead


def run_pp_steps(family: str, world: int, frozen: bool = False, mtp: bool = False) -> dict[str, Any]:
    """Three steps (rows without and with an image, right-padded rows, packed rows; two micro-batches of two rows
    each) of the recipe's step: in one process (``world`` 1), or as the engine runs it over pp 2 (FSDP2 on each
    stage, the recipe's ``pipeline_batches`` through 1F1B with one-row micro-batches, a Qwen3-VL's DeepStack maps
    travelling as the recipe sets them up): the losses and gradient norms. ``frozen``: the vision tower frozen,
    the stages with static shapes (``pp_seq_len`` 128). ``mtp``: the model with MTP heads (:data:`MTP`), their
    embeddings carried from the first stage to the last as the engine sets them up (``carry_heads``), the loss the
    recipe's with theirs, every token of the packed rows a label; also the heads' weights after the steps (the rank
    that holds them)."""
    from automodel.mtp.attach import attach_heads
    from automodel.mtp.heads import MTPSettings, find_heads
    from automodel.mtp.pipeline import carry_heads
    from automodel.training.parallel.mesh import PP
    from automodel.training.parallel.pipeline_parallel import PipelineSettings, StagePipelines
    from automodel.training.parallel.pipeline_stages import split_model
    from automodel.training.parallel.pipeline_static import StaticShapes
    from automodel_vlm.deepstack import travel_deepstack

    model, processor = tiny_model(family)
    if mtp:
        attach_heads(model, MTPSettings(**MTP), None)
    if frozen:
        model.model.visual.requires_grad_(False)
    batches = [text_first_micro_batches(processor), micro_batches(processor, 0, 8),
               micro_batches(processor, 1, 8, rope_index(model))]
    if mtp:  # every packed token a label: a depth's targets in the next sample count unless the heads drop them
        for batch in batches[2]:
            batch["labels"] = batch["input_ids"].masked_fill(batch["input_ids"] == processor.tokenizer.pad_token_id,
                                                             IGNORE_INDEX)
    if world == 1:
        step = Step(model, processor, MeshLayout(1), None)
    else:
        from automodel.training.parallel.multimodal_fsdp import multimodal_modules

        layout = plan_mesh(world, pp_size=2, cp_size=world // 2)
        device_mesh = build_device_mesh(layout, "cpu")
        (stage,) = split_model(model, device_mesh[PP].get_local_rank(), layout.pp)
        carry_heads(model, [stage])
        if layout.cp > 1:
            causal_attention_without_mask(stage, multimodal_modules(stage, MULTIMODAL_NAMES).values())
        apply_fsdp2(stage, fsdp_mesh(device_mesh, layout), multimodal=place_multimodal(stage, MULTIMODAL_NAMES,
                                                                                         "root"))
        line = travel_deepstack(stage)  # as the recipe does, on the built stage
        assert line is None or "layers 2-2 travel beside the hidden states" in line, line
        step = Step(stage, processor, layout, device_mesh)
        text = model.config.text_config
        shapes = StaticShapes(128, text.hidden_size, text.vocab_size, torch.float32, torch.float32, cp=layout.cp,
                              carried=MTP["depths"] if mtp else 0) if frozen else None
        step.pipelines = StagePipelines([stage], device_mesh[PP], torch.device("cpu"), PipelineSettings(),
                                        step.pipeline_loss, shapes, cp_mesh=device_mesh[CP] if layout.cp > 1 else None)
    step.mtp_heads = find_heads(step.model)
    results = [step._train_step(b) for b in batches]
    found = {"losses": [loss.item() for loss, _, _ in results], "norms": [norm.item() for _, norm, _ in results]}
    if mtp:
        state = full_state(step.model)
        found["heads"] = {key: value.tolist() for key, value in state.items() if key.startswith("mtp.")}
    return found


def scenario_vlm_pp_mtp(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """Qwen3.5 (dense and MoE) with MTP heads: :func:`run_pp_steps` in one process, or pp 2 on two ranks; once more
    with the vision tower frozen and, pipelined, static stage shapes (the embeddings in them)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {**{family: run_pp_steps(family, world, mtp=True) for family in ("qwen3_5", "qwen3_5_moe")},
            "qwen3_5_static": run_pp_steps("qwen3_5", world, frozen=True, mtp=True)}


def scenario_vlm_pp_qwen3(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """Qwen3-VL and Qwen3.5: :func:`run_pp_steps` in one process, or pp 2 on two ranks; Qwen3-VL over pp 2 x cp 2
    on four ranks; with ``cp`` in ``args`` Qwen3-VL's :func:`run` (cp 2 alone on two ranks, or one process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.get("cp"):  # Qwen3-VL under cp 2 alone (the reference: run in one process)
        found = run("qwen3_vl", plan_mesh(world, cp_size=2) if world > 1 else MeshLayout(1))
        return {"qwen3_vl_cp": {key: found[key] for key in ("losses", "norms", "vision_grads")}}
    if world == 4:  # pp 2 x cp 2
        return {"qwen3_vl": run_pp_steps("qwen3_vl", world), "qwen3_vl_frozen": run_pp_steps("qwen3_vl", world, True)}
    return {**{family: run_pp_steps(family, world) for family in ("qwen3_vl", "qwen3_5")},
            "qwen3_vl_frozen": run_pp_steps("qwen3_vl", world, frozen=True)}


def scenario_vlm_cp_paligemma(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """PaliGemma under cp = world size (2), or the one-process reference without a process group (:func:`run`, rows
    padded to a multiple of 4 in both), once more on the cp ranks with its layers left bidirectional as
    transformers' config marks them (their SDPA calls then not the region's)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = plan_mesh(world, cp_size=world) if world > 1 else MeshLayout(1)
    keys = ("losses", "norms", "hooked")
    results = {"paligemma": {key: run("paligemma", layout, pad_to=4 // layout.cp)[key] for key in keys}}
    if world > 1:
        globals()["causal_prefix_attention"] = lambda model: 0
        results["paligemma_bidirectional"] = {key: run("paligemma", layout, pad_to=2)[key] for key in keys}
    return results


def scenario_vlm_pp_cp(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """pp 2 x cp 2 on four ranks: :func:`run_pipelined` for the Qwen2-VL."""
    return {"qwen2_vl": run_pipelined("qwen2_vl", plan_mesh(dist.get_world_size(), pp_size=2, cp_size=2))}


def qwen3_vl_tower_split(cp_mesh: Any) -> dict[str, Any]:
    """A tiny Qwen3-VL vision tower (deepstack features) on a three-frame video and two images, frame-sharded
    against whole on this rank: the largest differences of the features and, each rank taking half of a loss on
    them, of the parameter gradients summed over the ranks; and the grid rows this rank ran."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    config = Qwen3VLConfig(vision_config={
        "depth": 3, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 8, "out_hidden_size": 24,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [0, 1],
        "num_position_embeddings": 64}).vision_config
    config._attn_implementation = "sdpa"
    tower = Qwen3VLVisionModel._from_config(config)
    grid = torch.tensor([[3, 6, 8], [1, 4, 4], [1, 4, 6]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1))

    def loss(out: Any) -> torch.Tensor:
        return out.pooler_output.sin().sum() + sum(part.cos().sum() for part in out.deepstack_features)

    whole = tower(pixels, grid_thw=grid, return_dict=True)
    loss(whole).backward()
    reference = {name: param.grad.clone() for name, param in tower.named_parameters()}
    tower.zero_grad()
    sharding = FrameSharding(tower, cp_mesh, {"min_tokens": 0})
    grids: list[list] = []
    tower.register_forward_pre_hook(lambda _, args, kwargs: grids.append(kwargs["grid_thw"].tolist()),
                                    with_kwargs=True)
    with sharding.active():
        split = tower(pixels, grid_thw=grid, return_dict=True)
    (loss(split) / 2).backward()
    features = max((a - b).abs().max().item() for a, b in zip([split.pooler_output, *split.deepstack_features],
                                                              [whole.pooler_output, *whole.deepstack_features],
                                                              strict=True))
    grads = 0.0
    for name, param in tower.named_parameters():
        dist.all_reduce(param.grad, group=cp_mesh.get_group())
        grads = max(grads, (param.grad - reference[name]).abs().max().item())
    return {"features": features, "grads": grads, "grids": grids}


def scenario_vlm_cp(args: dict[str, Any], out: Any) -> dict[str, Any]:
    """cp = world size (2), or the one-process reference without a process group; every family, and on the cp
    ranks the Qwen2-VL with frame sharding (every batch split; a rank under 40 patch rows padded with zero frames), a
    Qwen3-VL tower split by frames, and Gemma 3 and 4 once more with their image spans left out of the mask (causal
    attention only)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = plan_mesh(world, cp_size=world) if world > 1 else MeshLayout(1)
    results = {family: run(family, layout) for family in ("llava", "qwen2_vl", "gemma3", "gemma4")}
    if world > 1:
        results["qwen2_vl_frames"] = run("qwen2_vl", layout, {"min_tokens": 0, "min_local_patch_rows": 40})
        results["qwen3_vl_tower"] = qwen3_vl_tower_split(build_device_mesh(layout, "cpu")[CP])
        import automodel_vlm.recipe

        automodel_vlm.recipe.two_way_spans = lambda config, inputs: None
        results |= {f"{family}_causal": run(family, layout) for family in ("gemma3", "gemma4")}
    return results



if __name__ == "__main__":
    main(globals())

