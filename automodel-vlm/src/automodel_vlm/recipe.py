"""Vision-language fine-tuning on the core's shared loop: image + conversation in, loss on assistant tokens."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from automodel.chat_template import chat_template_problem, resolve_chat_template
from automodel.config import ConfigNode, Target
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import EvalGenerationConfig, check_vocab, model_source
from automodel.meta_build import MetaBuild
from automodel.model_backend import attention_split_note
from automodel.training.checkpoint_write import sharded_only_message
from automodel.training.context import BuildContext
from automodel.training.modules import root_gathered, unwrap
from automodel.training.mtp_loss import MTPLoss
from automodel.training.next_token import (
    LABEL_POSITIONS,
    HeadOnPositions,
    NextTokenLogits,
    split_next_token_logits,
)
from automodel.training.parallel.context_parallel import ContextParallelBatch, cp_attention
from automodel.training.parallel.mesh import CP
from automodel.training.parallel.pipeline_media import media_kwargs
from automodel.training.parallel.pipeline_parallel import StagePipelines
from automodel.training.parallelism import model_hf_config, validation_device
from automodel.training.pipeline_steps import padded_tokens, pipeline_length, stage_kwargs
from automodel.training.recipe import TrainRecipe
from automodel.training.recipe_sections import data_sections
from automodel_vlm.context_parallel import (
    MultimodalContextParallelBatch,
    SequenceSplit,
    attention_issue,
    causal_prefix_attention,
    two_way_spans,
    two_way_stages,
)
from automodel_vlm.datasets.collate import IGNORE_INDEX, VLMCollator, render
from automodel_vlm.datasets.packing import (
    PackedVLMCollator,
    PackedVLMDataset,
    VLMPackedSequenceConfig,
    packed_attention_note,
    packing_issues,
    packing_unsupported,
    rope_index,
)
from automodel_vlm.datasets.text_chat import text_chat_issues
from automodel_vlm.deepstack import travel_deepstack
from automodel_vlm.drafter import DRAFTER_DIR, drafter_issues, find_composite, uses_drafter
from automodel_vlm.frame_sharding import FrameSharding, attach_frame_sharding, frame_sharding_issues
from automodel_vlm.freeze import UpstreamFreezeConfig, VLMFreezeConfig
from automodel_vlm.gemma4_pipeline import travel_gemma4
from automodel_vlm.parts import MULTIMODAL_NAMES, base_model, find_part
from automodel_vlm.pipeline import (
    layout_issue,
    mask_kwargs,
    media_per_row,
    pipeline_issues,
    rope_positions,
)

DATASET_ARGS = ("config_key", "processor")
# upstream's data set key the recipe reads itself (checked in check_config, applied in setup_domain)
DATASET_BUILDER_ARGS = {"chat_template": "upstream's: a Jinja chat template, inline or the path of a file (.jinja, or "
                                         "JSON with a chat_template key), set on the processor and its tokenizer "
                                         "before the data sets are built (a base model that ships none)"}


def _dataset_chat_templates(cfg: Any) -> dict[str, str]:
    """``<section>.chat_template`` -> its value, for every data set section that gives one."""
    return {f"{name}.chat_template": node["chat_template"] for name, node in data_sections(cfg).items()
            if node.get("chat_template") is not None}


def _chat_template_issues(cfg: Any) -> list[ConfigIssue]:
    """Each data set's chat template must be one; the processor takes one, so they must agree."""
    templates = _dataset_chat_templates(cfg)
    issues = [ConfigIssue(key, problem) for key, value in templates.items()
              if (problem := chat_template_problem(value)) is not None]
    if not issues and len({resolve_chat_template(value, key) for key, value in templates.items()}) > 1:
        issues.append(ConfigIssue(", ".join(templates), "the data sets give different chat templates, but the one "
                                  "processor takes one: give it once (dataset.chat_template)"))
    return issues


def _processor_source(model: Any) -> str | None:
    """Where the model section loads from (its processor is there too), if it names a directory or hub name."""
    found = model_source(model, ("pretrained_model_name_or_path", "name_or_path"))
    return found[0] if found else None


def _processor_needs_model_source(cfg: Any) -> bool:
    """Whether the processor is the model's own: no ``processor:`` section, or one with neither ``_target_`` nor a
    path (upstream passes such a section's keys, ``padding_side: right`` say, to AutoProcessor of the model's path)."""
    if "processor" not in cfg:
        return True
    section = cfg.resolved["processor"]
    named = {"_target_", "pretrained_model_name_or_path", "name_or_path"}
    return isinstance(section, dict) and not named & set(section)


def context_parallel_issues(cfg: Any) -> list[ConfigIssue]:
    """What the VLM recipe cannot run with ``distributed.cp_size > 1``: a model whose attention the chosen one does
    not compute (ring attention and image tokens that attend both ways), packed rows with ring attention or of a
    length the split does not divide. (With pipeline parallelism the first stage merges the media into the whole
    rows and then splits them, ``PipelineStageModel.takes_whole_rows``; ring attention there is the core's refusal.
    Generation runs outside the context-parallel region, on whole sequences with the model's own mask, as in one
    process.)"""
    cp = cfg.distributed.cp_size
    issues = []
    config = model_hf_config(cfg)
    chosen = cp_attention(cfg, validation_device(), config)
    if config is not None and (issue := attention_issue(config, chosen)) is not None:
        issues.append(ConfigIssue("distributed.cp_size", f"{cp}: {issue}"))
    issues += frame_sharding_issues(cfg, config)
    packing = cfg.packed_sequence if "packed_sequence" in cfg else None
    if packing is None:  # none, or one its own schema refused
        return issues
    length = packing.padded_length
    if chosen == "ring":
        issues.append(ConfigIssue("packed_sequence", f"packed rows keep attention within each sample, but torch's "
                                  f"ring attention (distributed.cp_attention: ring, cp_size {cp}) runs one causal "
                                  "attention over the whole row; set distributed.cp_attention: all_gather (or auto), "
                                  "which keeps the samples apart, or remove the section"))
    elif length % (2 * cp):
        issues.append(ConfigIssue("packed_sequence.pack_size", f"packed rows of {length} tokens: context parallelism "
                                  f"(cp_size {cp}) splits each row into {2 * cp} chunks; use a multiple of {2 * cp} "
                                  "(pack_size, or collate_max_length where set)"))
    return issues


class FinetuneRecipeForVLM(MTPLoss, NextTokenLogits, TrainRecipe):
    """Fine-tunes an image-text-to-text model (Llava-style and others) on image conversations."""

    domain = "vlm"
    # the language model's projections and head are sharded by its own plan (transformers' tp_plan of the composite
    # model); the vision tower and projector stay replicated over tp; the loss runs on vocabulary-parallel logits
    tensor_parallel_unsupported = None
    # the composite model is cut along its language model; each micro-batch's media reach the first stage with its
    # rows (automodel_vlm.pipeline: the model's media layout); pipeline_batches below
    pipeline_parallel_unsupported = None
    # every cp rank runs the vision tower (or its share of the frames: automodel_vlm.frame_sharding) and the merge on
    # the whole batch; the language model gets the rank's part of the merged sequence (automodel_vlm.context_parallel)
    context_parallel_unsupported = None
    sequence_split: SequenceSplit | None = None
    frame_sharding: FrameSharding | None = None  # distributed.multimodal.vision.frame_sharding (cp > 1)
    hf_artifacts = ("processor",)
    multimodal_module_names = MULTIMODAL_NAMES  # FSDP2 places them by distributed.multimodal.frozen_sharding
    stage_implementations = {"peft": "vlm_lora", "freeze": "vlm"}
    sections = {
        "processor": Target("the processor (image processor + tokenizer + chat template; default: the model's, "
                            "with the section's keys when it names neither _target_ nor a path): "
                            "{pretrained_model_name_or_path: ...} or {_target_: automodel_vlm.processor."
                            "build_processor, image_processor: ..., tokenizer: ..., ...}", plain=True,
                            default_target="automodel_vlm.processor.load_processor"),
        "dataset": Target("the training data set", required=True, runtime_args=DATASET_ARGS,
                         builder_args=DATASET_BUILDER_ARGS),
        "validation_dataset": Target("a validation data set", runtime_args=DATASET_ARGS,
                         builder_args=DATASET_BUILDER_ARGS),
        "validation_dataset_*": Target("more validation data sets, reported by name", runtime_args=DATASET_ARGS,
                         builder_args=DATASET_BUILDER_ARGS),
        "peft": Target("LoRA adapters on the language model: {dim, alpha, dropout, target_modules | "
                       "match_all_linear} (or _target_: peft.LoraConfig, used as given)", plain=True,
                       default_target="automodel.hf.PeftConfig"),
        "freeze": VLMFreezeConfig,
        "freeze_config": UpstreamFreezeConfig,
        "packed_sequence": VLMPackedSequenceConfig,
        "eval_generation": EvalGenerationConfig,
    }

    @classmethod
    def check_config(cls, cfg: Any) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        settings = cfg.distributed
        if "packed_sequence" in cfg:
            issues += packing_issues(cfg)
        issues += text_chat_issues(cfg) + _chat_template_issues(cfg)
        if settings is not None and settings.tp_size > 1 and settings.sequence_parallel:
            issues.append(ConfigIssue("distributed.sequence_parallel", f"true with tp_size {settings.tp_size}: "
                                      "sequence parallelism is not implemented for vision-language models (the image "
                                      "features are merged into the text sequence before the language model's "
                                      "layers, and the vision tower's layers would be split too); set it to false"))
        if settings is not None and settings.pp_size > 1:
            issues += pipeline_issues(cfg, model_hf_config(cfg))
        if settings is not None and settings.cp_size > 1:
            issues += context_parallel_issues(cfg)
        issues += cls.mtp_config_issues(cfg)
        if uses_drafter(cfg):
            issues += drafter_issues(cfg)
        if "freeze" in cfg and "freeze_config" in cfg:
            issues.append(ConfigIssue("freeze_config", "give one of freeze (ours) and freeze_config (upstream's "
                                                       "keys): they set the same thing"))
        model = cfg.model
        if _processor_needs_model_source(cfg) and model is not None and _processor_source(model) is None:
            issues.append(ConfigIssue("processor", "missing: the model is not loaded from a directory or hub name "
                                                   "whose processor could be used; add `processor: "
                                                   "{pretrained_model_name_or_path: ...}` or build one from its parts "
                                                   "(_target_: automodel_vlm.processor.build_processor)"))
        return issues

    # ---- building -------------------------------------------------------------------------------------------

    def setup_domain(self) -> None:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        self.processor = self._processor()
        template = next(iter(_dataset_chat_templates(self.cfg).items()), None)
        if template is not None:  # upstream's dataset.chat_template: the processor's and its tokenizer's
            key, value = template
            self.processor.chat_template = resolve_chat_template(value, key)
            if getattr(self.processor, "tokenizer", None) is not None:
                self.processor.tokenizer.chat_template = self.processor.chat_template
            self.log(f"{key}: the processor's chat template (and its tokenizer's)")
        from automodel_vlm.family_processors import pillow_twin_note

        if (note := pillow_twin_note(self.processor)) is not None:
            self.log(note)
        if isinstance(self.cfg.model, ConfigNode) and (note := attention_split_note(self.cfg.model.to_dict())):
            self.log(note)

    def _processor(self) -> Any:
        node = self.cfg.processor
        if not _processor_needs_model_source(self.cfg):
            return node.instantiate(default_target="automodel_vlm.processor.load_processor")
        source = _processor_source(self.cfg.model)
        if source is None:
            raise AutomodelError("processor: none found; add `processor: {pretrained_model_name_or_path: ...}` "
                                 "or build one from its parts (automodel_vlm.processor.build_processor)")
        if node is None:
            from automodel_vlm.processor import load_processor

            return load_processor(source)
        # upstream's rule: the section's keys go to AutoProcessor.from_pretrained of the model's source
        return node.instantiate(default_target="automodel_vlm.processor.load_processor",
                                pretrained_model_name_or_path=source)

    def dataset_runtime_args(self, node: Any) -> dict[str, Any]:
        # errors in a row name the section it came from; the processor measures samples (MockVLMDataset.max_length)
        return {"config_key": node.key, "processor": self.processor}

    @property
    def packing(self) -> VLMPackedSequenceConfig | None:
        return self.cfg.packed_sequence if "packed_sequence" in self.cfg else None

    def build_dataset(self, ctx: BuildContext, node: Any) -> Any:
        if node is not None and "chat_template" in node:  # applied to the processor in setup_domain
            node = ConfigNode({k: v for k, v in node.to_dict().items() if k != "chat_template"}, node.key,
                              node.resolver)
        dataset = super().build_dataset(ctx, node)
        if node is not None and node.key == "dataset" and self.packing is not None:
            dataset = PackedVLMDataset(dataset, self.packing.sample_collator(self.processor), self.packing)
            left_out = ", ".join([f"{n} left out by {key}" for key, n in dataset.left_out.items() if n]
                                 + ([f"{dataset.cut} cut to max_length"] if dataset.cut else []))
            order = ", balanced by image tokens" if self.packing.balance_media_tokens else ""
            self.log(f"packed the training data into {len(dataset)} rows of {self.packing.pack_size} tokens{order}"
                     + (f" ({left_out})" if left_out else ""))
            if note := packed_attention_note(self.packing, ctx.mesh.cp):
                self.log(note)
        return dataset

    def build_dataloader(self, ctx: BuildContext, dataset: Any, node: Any, train: bool) -> Any:
        if isinstance(dataset, PackedVLMDataset):  # each sample tokenized (and cut) as when it was measured
            collate = PackedVLMCollator(dataset.collator, self.packing.padded_length, rope_index(self.model),
                                        dataset.cut_to)
            return ctx.build("dataloader", dataset, node, train, collate)
        return super().build_dataloader(ctx, dataset, node, train)

    def _cp_multiple(self) -> int | None:
        # context parallelism splits each row into 2 x cp_size chunks
        settings = self.cfg.distributed
        return 2 * settings.cp_size if settings is not None and settings.cp_size > 1 else None

    def default_collate_fn(self, train: bool = True) -> Any:
        return VLMCollator(self.processor, pad_to_multiple_of=self._cp_multiple())

    def collate_runtime_args(self) -> dict[str, Any]:
        # upstream calls its VLM collate functions with the processor (here: VLMCollator, see plugin.py); under
        # context parallelism a collator that pads (VLMCollator's kin) pads each row to the chunks' multiple, as
        # the default collate does, unless its section sets pad_to_multiple_of itself
        multiple = self._cp_multiple()
        return {"processor": self.processor} | ({"pad_to_multiple_of": multiple} if multiple else {})

    def after_model_built(self, ctx: BuildContext, model: torch.nn.Module, meta: MetaBuild) -> BuildContext:
        """Under pipeline parallelism, a model whose media layout is not known is refused before it is cut."""
        why = layout_issue(model.config) if ctx.mesh.pp > 1 else None
        if self.packing is not None and packing_unsupported(model) is not None:
            raise AutomodelError(f"packed_sequence: {packing_unsupported(model)}")
        if why is not None:
            raise AutomodelError(f"distributed.pp_size: {ctx.mesh.pp}: {why}")
        config = getattr(model, "config", None)
        if ctx.mesh.cp > 1 and config is not None and (
                issue := attention_issue(config, cp_attention(ctx.cfg, ctx.device, config))) is not None:
            raise AutomodelError(f"distributed.cp_size: {ctx.mesh.cp}: {issue}")  # a config validation could not read
        return super().after_model_built(ctx, model, meta)

    def build_pipelines(self, ctx: BuildContext) -> StagePipelines | None:
        """Before the schedules: a DeepStack model's stages carry its feature maps to the layers that add them
        (``automodel_vlm.deepstack``), a Gemma 4's its per-layer inputs and shared keys and values
        (``automodel_vlm.gemma4_pipeline``); under context parallelism a Gemma's stages the rule for its spans
        of tokens that attend both ways (``context_parallel.two_way_stages``)."""
        for travel in (travel_deepstack, travel_gemma4) if ctx.mesh.pp > 1 else ():
            if (line := travel(self.model)) is not None:
                self.log(line)
        if ctx.mesh.pp > 1 and ctx.mesh.cp > 1:  # the stages' attention takes Gemma's image spans
            two_way_stages(self.model)
        return super().build_pipelines(ctx)

    def setup(self) -> None:
        super().setup()
        if self.ctx.mesh.cp > 1 and self.ctx.mesh.pp == 1:  # pipelined: the first stage splits after the merge
            language_model = find_part(self.model, "language_model")
            if language_model is None:
                raise AutomodelError(f"distributed.cp_size: {self.ctx.mesh.cp}: context parallelism splits the "
                                     "sequence the language model runs on, but this model has no module named "
                                     "language_model, text_model or llm; set cp_size: 1")
            self.sequence_split = SequenceSplit(language_model[1], self.ctx.device_mesh[CP])
            causal_prefix_attention(self.model)  # PaliGemma's layers: the region's attention takes its prefix
            self.frame_sharding = attach_frame_sharding(self.model, self.cfg, self.ctx.device_mesh[CP])
        composite = find_composite(self.model)
        if composite is not None:  # model/ is the base, model/drafter/ the drafter: two Hugging Face directories
            self.save_model = self.save_joint_model
            self.log(f"Gemma4WithDrafter: the training loss is the base's next-token loss + "
                     f"{composite.drafter_loss_weight:g} x the sum over {composite.drafter_num_steps} drafting "
                     "round(s) of each one's loss, all per label token (upstream's), logged as loss_base and "
                     "loss_drafter; validation reports the base's loss only")
        config = getattr(base_model(self.model), "config", None)
        check_vocab(self.processor.tokenizer, getattr(config, "text_config", None) or config,
                    "processor: its tokenizer has {tokens} tokens but the model's vocab_size is {vocab}; use the "
                    "model's own processor or resize its embeddings")
        image_id = getattr(config, "image_token_id", None)
        if image_id is None:
            image_id = getattr(config, "image_token_index", None)
        # Gemma 3's processor (transformers 5) names the start-of-image token as its image token and expands it to
        # the tokenizer's image token, the model's: either id belongs to the processor
        processor_ids = {getattr(self.processor, "image_token_id", None),
                         getattr(getattr(self.processor, "tokenizer", None), "image_token_id", None)} - {None}
        if image_id is not None and processor_ids and image_id not in processor_ids:
            raise AutomodelError(f"processor: its image token id is {min(processor_ids)} but the model's "
                                 f"image_token_index is {image_id}; the processor and model do not belong together")

    # ---- the loss ---------------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The next-token loss (with MTP heads': :class:`MTPLoss`) plus, while training a Gemma 4 model jointly
        with its drafter, ``drafter_loss_weight`` x the drafter's (:meth:`automodel_vlm.drafter.Gemma4WithDrafter.
        drafter_loss`); each part is logged (``loss_base``, ``loss_drafter``)."""
        loss = super().compute_loss(model, batch)
        composite = find_composite(model)
        if composite is None or not model.training:
            return loss
        drafter = composite.drafter_loss(batch["labels"], self.loss_fn)
        self.add_loss_part("base", loss)
        self.add_loss_part("drafter", drafter)
        return loss + composite.drafter_loss_weight * drafter

    def save_joint_model(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """model/: the base, with the processor's files; model/drafter/: the drafter (rank 0)."""
        find_composite(self.model).save_pretrained(directory, state_dict)
        self.save_artifacts(directory)

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        composite = find_composite(model)
        if composite is None:
            super().load_model_weights(model, directory)
        else:
            composite.load_weights(directory)

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in batch.items() if k not in ("labels", LABEL_POSITIONS, "token_count")},
                "use_cache": False}

    def context_parallel_batch(self, batch: dict[str, Any]) -> MultimodalContextParallelBatch:
        """The whole micro-batch for the model's forward (every rank merges all of its images), the next-token
        targets, which the region splits (padding checked as for text), and the spans the model lets attend both
        ways (its images, from the whole rows' token types; None where it attends causally)."""
        split = super().context_parallel_batch(batch)
        inputs = self.model_inputs(batch)
        spans = two_way_spans(getattr(base_model(self.model), "config", None), inputs)
        return MultimodalContextParallelBatch(split.input_ids, split.position_ids, split.targets,
                                              split.attention_mask, spans, inputs=inputs)

    def next_token_logits(self, model: torch.nn.Module, batch: dict[str, Any] | ContextParallelBatch,
                          head: HeadOnPositions | None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, MultimodalContextParallelBatch):  # setup attached sequence_split (cp > 1)
            frames = self.frame_sharding.active() if self.frame_sharding is not None else contextlib.nullcontext()
            with self.sequence_split.active(), frames:
                return split_next_token_logits(model, batch, head, self.loss_head)
        return super().next_token_logits(model, batch, head)

    def pipeline_batches(self, batches: list[dict[str, torch.Tensor]], length: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """The step's micro-batches padded to :func:`pipeline_length` (the padding is masked out and carries no
        label; packed rows keep no mask and every stage gets their position ids, see :func:`stage_kwargs`), each
        with its media regrouped per row (``pipeline_media``) so that every pipeline micro-batch's first stage gets
        exactly its rows' images, the model's multi-axis rope positions where it has them
        (:func:`rope_positions`: every stage needs them), and the token types every stage builds the masks from
        where the model's image tokens attend to each other both ways (:func:`mask_kwargs`)."""
        longest = pipeline_length(batches, length)
        pad = self.processor.tokenizer.pad_token_id or 0
        config = base_model(self.model).config
        rope = rope_index(self.model)
        parts = []
        for batch in batches:
            batch = rope_positions(batch, config, rope)
            extra = longest - batch["input_ids"].shape[1]
            kwargs = {**stage_kwargs(batch, extra), **media_kwargs(media_per_row(batch, config)),
                      **mask_kwargs(batch, config, extra)}
            parts.append((*padded_tokens(batch, extra, pad), kwargs))
        return parts

    def count_label_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def count_input_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        if "token_count" in batch:  # packed rows: their padding is no input
            return int(batch["token_count"].sum())
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    # ---- after training ------------------------------------------------------------------------------------

    def _validation_set(self) -> Any:
        for loader in self.val_dataloaders.values():
            if hasattr(loader.dataset, "qa_pairs"):
                return loader.dataset
        return None

    @torch.no_grad()
    def answer(self, messages: list[dict], images: list[Any], max_new_tokens: int,
               videos: list[Any] | None = None) -> str:
        """Greedy answer of the model to a conversation that ends before an assistant turn (``videos``: its clips,
        :class:`~automodel_vlm.datasets.videos.Clip`)."""
        model = unwrap(self.model)
        prompt = render(self.processor, messages, generation_prompt=True)
        needed = sum(1 for m in messages for p in m["content"] if p.get("type") == "image")
        kwargs: dict[str, Any] = {"images": images[:needed]} if needed else {}
        clips = (videos or [])[:sum(1 for m in messages for p in m["content"] if p.get("type") == "video")]
        if clips:
            kwargs.update(videos=[clip.frames for clip in clips], video_metadata=[clip.metadata for clip in clips])
        inputs = self.processor(text=[prompt], return_tensors="pt", add_special_tokens=False, **kwargs)
        inputs = self.move_to_device(dict(inputs))
        tokenizer = self.processor.tokenizer
        with self.forward_context():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                    synced_gpus=self.forwards_are_collective)
        new = output[0, inputs["input_ids"].shape[1]:]
        return tokenizer.decode(new, skip_special_tokens=True).strip()

    def exact_match(self, dataset: Any, limit: int | None, max_new_tokens: int) -> tuple[float, list[tuple]]:
        pairs = dataset.qa_pairs[:limit] if limit else dataset.qa_pairs
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        try:
            with root_gathered(model):  # generate runs the image encoder outside the FSDP2 root's forward
                results = [(prefix, expected, self.answer(prefix, sample["images"], max_new_tokens,
                                                          sample.get("videos")))
                           for index, prefix, expected in pairs for sample in [dataset[index]]]
        finally:
            model.train(was_training)
        score = sum(got == expected for _, expected, got in results) / max(len(results), 1)
        return score, results

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        settings = self.cfg.eval_generation
        dataset = self._validation_set()
        # FSDP2: every rank generates the same answers together (each forward gathers the sharded weights)
        if settings is not None and settings.enabled and dataset is not None and \
                (self.is_main_process or self.forwards_are_collective) and "eval_generation" in self.cfg:
            score, results = self.exact_match(dataset, settings.num_examples, settings.max_new_tokens)
            for prefix, expected, got in results[: settings.num_shown]:
                question = " ".join(p.get("text", "") for p in prefix[-1]["content"] if p.get("type") == "text")
                media = "".join(f"[{p['type']}] " for p in prefix[-1]["content"] if p.get("type") in ("image", "video"))
                self.log(f"  Q: {media or '[image] '}{question}\n     expected: {expected!r}  model: {got!r}")
            self.log(f"exact match on {len(results)} validation questions: {score:.3f}")
            if final_checkpoint is not None and self.is_main_process:
                record = {"step": self.step_scheduler.step, "exact_match": score, "num_questions": len(results)}
                with open(Path(self.cfg.checkpoint.checkpoint_dir) / "eval_generation.json", "w") as f:
                    json.dump(record, f)
        if final_checkpoint is not None:
            model_dir = final_checkpoint / "model"
            if not model_dir.is_dir():
                self.log(sharded_only_message(final_checkpoint))
            elif (model_dir / "adapter_config.json").is_file():
                self.log(f"Trained LoRA adapter in {model_dir}: load it with peft.PeftModel.from_pretrained("
                         f"base_model, '{model_dir}') and AutoProcessor.from_pretrained('{model_dir}')")
            else:
                self.log(f"Trained model in {model_dir}: load it with transformers.AutoModelForImageTextToText."
                         f"from_pretrained('{model_dir}') and AutoProcessor.from_pretrained('{model_dir}')")
            if (model_dir / DRAFTER_DIR).is_dir():
                self.log(f"Trained drafter in {model_dir / DRAFTER_DIR}: load it with transformers."
                         f"Gemma4AssistantForCausalLM.from_pretrained('{model_dir / DRAFTER_DIR}')")
