"""Text-to-image and text-to-video diffusion training (``finetune diffusion`` / ``pretrain diffusion``) on the core's
shared loop.

What differs from the LLM recipe is only what the engine lets a domain override: the model is an
``AutoDiffusionPipeline`` (the trained components of a diffusers pipeline as one module), a micro-batch's loss is
the objective's per-image loss summed (the loop divides by the images of the step), checkpoints are diffusers
pipeline directories (with ``peft:``, the denoiser's LoRA adapter in diffusers' LoRA format), and each
validation step also writes a PNG grid of samples from fixed prompts and seeds. With upstream's
``model.pipeline_spec.load_full_pipeline: false`` only the transformer is loaded; it trains on a latent cache
(``automodel_diffusion.latents``) and checkpoints hold it alone, in diffusers' layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from automodel.config import Config, ConfigNode, Free, Target, require_positive
from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.hf import model_source
from automodel.model_files import parse_dtype
from automodel.training.checkpoint import CheckpointError, load_safetensors_dir, load_weights_into
from automodel.training.context import BuildContext
from automodel.training.dist import expected_world_size
from automodel.training.modules import unwrap
from automodel.training.parallel.activation_checkpointing import apply_activation_checkpointing
from automodel.training.recipe import TrainRecipe
from automodel_diffusion import latents, stages, upstream
from automodel_diffusion.datasets import collate_image_captions
from automodel_diffusion.edit import ImageEditDataset, collate_image_edits
from automodel_diffusion.lora import LORA_WEIGHTS, has_lora, load_lora, peft_issues, save_lora
from automodel_diffusion.objectives import ObjectiveConfig, build_objective
from automodel_diffusion.parallel import UNSUPPORTED_MESSAGE, parse_entry, scheme_issues
from automodel_diffusion.pipeline import (
    AutoDiffusionPipeline,
    index_issue,
    model_class,
    pipeline_components,
    read_model_index,
)
from automodel_diffusion.sampling import DEFAULT_FPS, call_kwargs, image_grid, sample_edits, sample_images, save_video

FROZEN_BASE = "pipeline_base"  # under checkpoint_dir: the frozen components, written once, hard-linked into each
_NOT_MODULES = ("Tokenizer", "Scheduler", "Processor", "FeatureExtractor")


@dataclass
class SampleGenerationConfig:
    enabled: bool = field(default=True, metadata={
        "help": "write a PNG grid of samples at each validation step (a video pipeline: an animated WebP grid)"})
    prompts: list[str] = field(default_factory=list, metadata={
        "help": "fixed prompts, one grid column each (empty: the first 4 distinct validation/training captions)"})
    num_images_per_prompt: int = field(default=1, metadata={"help": "grid rows: images per prompt"})
    seed: int = field(default=0, metadata={"help": "image (row r, column c) uses seed + r * len(prompts) + c"})
    num_inference_steps: int = field(default=4, metadata={"help": "denoising steps per sample"})
    guidance_scale: float = field(default=1.0, metadata={"help": "classifier-free guidance (1: off)"})
    height: int | None = field(default=None, metadata={"help": "sample height (null: the training resolution)"})
    width: int | None = field(default=None, metadata={"help": "sample width (null: the training resolution)"})

    def __post_init__(self) -> None:
        require_positive(self, "num_images_per_prompt", "num_inference_steps")


def objective_config(cfg: Config) -> ObjectiveConfig | None:
    """``objective:``, or the flow matching upstream's ``flow_matching:`` describes."""
    if "flow_matching" in cfg:
        return cfg.flow_matching.objective()
    return cfg.objective


def stage_objective(config: ObjectiveConfig | None, sigma_range: tuple[float, float] | None
                    ) -> ObjectiveConfig | None:
    """A two-expert stage's objective: its sigmas clamped into the stage's range (validation refuses another range
    given alongside, see ``stage_setting_issues``)."""
    if sigma_range is None:
        return config
    return dataclasses.replace(config or ObjectiveConfig(), sigma_min=sigma_range[0], sigma_max=sigma_range[1])


def stage_setting_issues(cfg: Config) -> list[ConfigIssue]:
    """Beside ``model.stage``: a sigma range written (the stage sets it), LoRA on the low-noise expert, a
    ``parallel_scheme`` entry for the idle expert."""
    stage = cfg.model.get("stage") if cfg.model is not None else None
    if stage is None:
        return []
    issues = []
    if stage == "low_noise" and "peft" in cfg:
        issues.append(ConfigIssue("peft", "LoRA on the low-noise expert (transformer_2) is not implemented: "
                                          "diffusers' Wan LoRA files name the transformer's layers; train the "
                                          "low_noise stage whole (remove peft:) or LoRA the high_noise stage"))
    idle = [name for name in stages.EXPERTS.values() if name != stages.EXPERTS.get(stage)]
    scheme = cfg.resolved.get("parallel_scheme")
    issues += [ConfigIssue(f"parallel_scheme.{name}", f"model.stage {stage} keeps {name}, the idle expert, frozen "
                                                      "on the CPU (it never runs in training): remove its entry")
               for name in idle if isinstance(scheme, dict) and name in scheme and stage in stages.EXPERTS]
    objective = objective_config(cfg)
    if objective is None:
        return issues
    section = "flow_matching" if "flow_matching" in cfg else "objective"
    defaults = ObjectiveConfig.__dataclass_fields__
    return issues + [ConfigIssue(f"{section}.{name}", f"{getattr(objective, name)}: model.stage sets the sigma "
                                                      "range (its expert's side of boundary_ratio); remove it")
                     for name in ("sigma_min", "sigma_max") if getattr(objective, name) != defaults[name].default]


def pipeline_layout(cfg: Config) -> tuple[list[str] | None, list[str] | None, str]:
    """(model components, trained components, denoiser name) as far as the config shows them unbuilt."""
    model = cfg.model
    trainable = list(model.get("trainable_components") or []) if model is not None else []
    expert = stages.EXPERTS.get(model.get("stage")) if model is not None else None
    trainable = [expert] if expert and not trainable else trainable
    source = model_source(model)
    index = read_model_index(source[0]) if source is not None else None
    if index is None:
        return None, trainable or None, trainable[0] if trainable else "transformer"
    components = [name for name, (_, cls) in pipeline_components(index).items()
                  if not any(word in cls for word in _NOT_MODULES)]
    denoiser = expert or next((n for n in ("transformer", "unet") if n in components), "transformer")
    return components, trainable or [denoiser], denoiser


def _link_tree(source: Path, target: Path) -> None:
    """``target`` gets ``source``'s files as hard links (copies where links are impossible)."""
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)


def save_component(component: Any, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """One component in its library's layout (``ComponentClass.from_pretrained(directory)`` loads it)."""
    import diffusers
    from safetensors.torch import save_file

    if state_dict is None:
        if isinstance(component, diffusers.ModelMixin):
            component.save_pretrained(str(directory), safe_serialization=True)
        else:
            component.save_pretrained(str(directory))
        return
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    if isinstance(component, diffusers.ModelMixin):
        component.save_config(str(directory))
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        config["_class_name"] = model_class(component).__name__  # not FSDP2's FSDP<Class>
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        save_file(tensors, str(directory / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    else:
        component.config.save_pretrained(str(directory))
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def saved_weights(component: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The weights ``save_component`` wrote in ``directory``, under ``component``'s own names: transformers saves
    some models under their original checkpoints' names (Qwen2.5-VL, Qwen-Image's text encoder: ``model.layers.*``
    for ``model.language_model.layers.*``), which only its ``from_pretrained`` maps back."""
    import transformers

    state = load_safetensors_dir(directory)
    if set(state) <= set(component.state_dict()) or not isinstance(component, transformers.PreTrainedModel):
        return state
    dtype = next(component.parameters()).dtype
    return type(component).from_pretrained(str(directory), dtype=dtype).state_dict()


class DiffusionRecipe(TrainRecipe):
    """Train a diffusers pipeline's denoiser (flow matching, epsilon or v-prediction) on images and captions."""

    domain = "diffusion"
    writes_diffusers_pipeline = True
    lora_model_is_adapter = True  # with peft:, model/ is the denoiser's adapter (save_model)
    stage_implementations = {"sharding": "diffusion", "peft": "diffusion_lora"}
    sections = {
        "model": Target("the diffusers pipeline: {_target_: automodel_diffusion.AutoDiffusionPipeline."
                        "from_pretrained, pretrained_model_name_or_path: ...} (or .from_config, config: <dir>); "
                        "without _target_, upstream's keys {pretrained_model_name_or_path, mode, torch_dtype, "
                        "compute_dtype, ...} (automodel_diffusion.upstream.load_upstream_pipeline)", required=True,
                        plain=True, default_target="automodel_diffusion.upstream.load_upstream_pipeline"),
        "parallel_scheme": Free("each pipeline component's strategy (ddp or fsdp2) and options, e.g. "
                                "{transformer: {strategy: fsdp2}, vae: {strategy: ddp}, text_encoder: "
                                "{strategy: ddp}}; required unless upstream's fsdp: or ddp: is given"),
        "fsdp": upstream.FsdpSection,
        "ddp": upstream.DdpSection,
        "objective": ObjectiveConfig,
        "flow_matching": upstream.FlowMatchingSection,
        "performance": upstream.PerformanceSection,
        "sample_generation": SampleGenerationConfig,
        "peft": Target("LoRA adapters on the denoiser: {dim, alpha, dropout, target_modules (names or globs such as "
                       "'*.to_q') | match_all_linear, exclude_modules} (or _target_: peft.LoraConfig, used as "
                       "given); checkpoints hold the adapter in diffusers' LoRA format", plain=True,
                       default_target="automodel.hf.PeftConfig"),
        "dataset": Target("the training images and captions: {_target_: automodel_diffusion.datasets."
                          "ImageCaptionDataset, path: ..., resolution: ...} (clips: VideoCaptionDataset, num_frames; "
                          "image edits: automodel_diffusion.edit.ImageEditDataset; or upstream's data.dataloader)"),
        "data": Free("upstream's {dataloader: {_target_: ...build_text_to_image_multiresolution_dataloader, "
                     "cache_dir, base_resolution, ...}}: cache_dir is a folder of images and captions here "
                     "(automodel_diffusion.upstream.text_to_image_data); ...build_video_multiresolution_dataloader: "
                     "a folder of clips and captions (automodel_diffusion.upstream.text_to_video_data); "
                     "...image_edit_dataset.ImageEditDataloaderConfig: a folder holding upstream's image-edit "
                     "manifest (automodel_diffusion.upstream.image_edit_data)"),
    }

    # ---- validation --------------------------------------------------------------------------------------------

    @classmethod
    def own_world(cls, data: dict, nodes: int = 1) -> tuple[int, int]:
        """``distributed.*``'s fewest processes, or upstream's ``fsdp:`` section's (its dp_size is the world)."""
        size, nodes = super().own_world(data, nodes)
        return max(size, upstream.fsdp_world(data)), nodes

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = super().check_config(cfg)
        if cfg.distributed is not None and cfg.distributed.strategy == "megatron_fsdp":
            issues.append(ConfigIssue("distributed.strategy", UNSUPPORTED_MESSAGE))
        world = upstream.world_issue(upstream.given(cfg, "fsdp"), expected_world_size())
        if world is not None:
            issues.append(world)
        issues += upstream.upstream_issues(cfg)
        issues += latents.transformer_alone_issues(cfg)
        issues += stage_setting_issues(cfg)
        source = model_source(cfg.model) if cfg.model is not None else None
        index = read_model_index(source[0]) if source is not None else None
        if index is not None and index_issue(index):
            issues.append(ConfigIssue("model", index_issue(index)))
            return issues
        if cfg.model is not None:
            issues += stages.stage_issues(cfg.model.get("stage"), cfg.model.get("boundary_ratio"), index, cfg.model)
        components, trainable, denoiser = pipeline_layout(cfg)
        issues += peft_issues(cfg, cfg.model.get("trainable_components") if cfg.model is not None else None,
                              denoiser)
        if not upstream.scheme_unchecked(cfg):
            issues += scheme_issues(upstream.effective_scheme(cfg, trainable, denoiser), components, trainable,
                                    denoiser)
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        lines = super().describe_plan(cfg)
        objective = objective_config(cfg)
        if objective is not None:
            lines.append(f"objective: {objective.type} ({objective.timestep_sampling} timesteps)")
        _, trainable, denoiser = pipeline_layout(cfg)
        scheme = upstream.effective_scheme(cfg, trainable, denoiser) or {}
        lines.append("parallel_scheme: " + ", ".join(
            f"{name}: {value if isinstance(value, str) else value.get('strategy')}" for name, value in scheme.items()))
        return lines

    # ---- building ----------------------------------------------------------------------------------------------

    def setup_domain(self) -> None:
        import datasets
        import diffusers
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
        self.loss_generator: torch.Generator | None = None
        self.upstream_loader: dict[str, Any] | None = None  # data.dataloader's loader settings

    def default_collate_fn(self, train: bool = True) -> Any:
        return collate_image_captions

    def build_dataset(self, ctx: BuildContext, node: ConfigNode | None) -> Any:
        """``dataset:``, or upstream's ``data.dataloader`` (its data set; its loader settings kept for the loader)."""
        if node is not None or "data" not in ctx.cfg:
            dataset = super().build_dataset(ctx, node)
        else:
            data = ctx.cfg.data["dataloader"].instantiate()
            self.upstream_loader = data.loader
            for note in data.notes:
                self.log(note)
            dataset = data.dataset
        if isinstance(dataset, latents.LatentCacheDataset):
            problem = latents.fit_issue(dataset.manifest, unwrap(self.model))
            if problem:
                raise AutomodelError(f"data: the latent cache '{dataset.folder}' does not fit the model: {problem}")
        return dataset

    def build_dataloader(self, ctx: BuildContext, dataset: Any, node: ConfigNode | None, train: bool) -> Any:
        if train and self.upstream_loader is not None:
            if "dataloader" in ctx.cfg:
                raise ConfigError(ConfigIssue("dataloader", "give the loader settings in data.dataloader (upstream's "
                                                            "section) or here, not both"))
            node = ConfigNode(dict(self.upstream_loader), "dataloader", ctx.cfg.resolver)
        own = {latents.LatentCacheDataset: latents.collate_latents, ImageEditDataset: collate_image_edits}
        collate = own.get(type(dataset)) or self.default_collate_fn(train)
        return ctx.build("dataloader", dataset, node, train, collate)

    def build_model(self, ctx: BuildContext) -> AutoDiffusionPipeline:
        """The pipeline as one module, with its objective; its frozen parts on the device, as the checkpoint being
        resumed holds them, and written once to ``pipeline_base`` (before the pipeline may shard them)."""
        import diffusers

        model = ctx.instantiate("model")
        if isinstance(model, diffusers.DiffusionPipeline):
            model = AutoDiffusionPipeline(model)
        if not isinstance(model, AutoDiffusionPipeline):
            raise AutomodelError(f"model: {ctx.cfg.model.target} built a {type(model).__name__}; diffusion trains a "
                                 "diffusers pipeline: use automodel_diffusion.AutoDiffusionPipeline.from_pretrained")
        components = [n for n, c in model.pipeline.components.items() if isinstance(c, torch.nn.Module)]
        scheme = upstream.effective_scheme(ctx.cfg, model.trainable_components, model.denoiser_name)
        issues = scheme_issues(scheme, components, model.trainable_components, model.denoiser_name)
        if issues:
            raise ConfigError(issues)
        problem = upstream.world_issue(upstream.given(ctx.cfg, "fsdp"), ctx.world_size)
        if problem:
            raise AutomodelError(str(problem))
        note = upstream.apply_adapter(ctx.cfg, model)
        if note:
            self.log(note)
        model.objective = build_objective(stage_objective(objective_config(ctx.cfg), model.sigma_range),
                                          model.pipeline.scheduler)
        if model.sigma_range is not None:
            self.log(f"model.stage: {ctx.cfg.model.get('stage')} trains {model.denoiser_name} on sigmas "
                     f"[{model.sigma_range[0]:g}, {model.sigma_range[1]:g}]; "
                     f"{', '.join(model.idle_experts())} stays frozen on the CPU")
        self.apply_upstream_settings(ctx, model, scheme)
        model.pipeline.set_progress_bar_config(disable=True)
        for name, component in model.frozen_components().items():
            if name not in model.idle_experts():
                component.to(ctx.device)
        if ctx.restore_path is not None:
            self.load_frozen_components(model, ctx.restore_path / "model")
        self.write_frozen_base(model)
        return model

    def apply_upstream_settings(self, ctx: BuildContext, model: AutoDiffusionPipeline, scheme: dict) -> None:
        """What fsdp: / ddp: / model.compute_dtype ask of the trained components: activation checkpointing,
        torch.compile, and the compute dtype (autocast, unless FSDP2 casts the parameters under torchrun)."""
        parallel = upstream.given(ctx.cfg, "fsdp") or upstream.given(ctx.cfg, "ddp")
        for name in model.trainable_components:
            component = model.components[name]
            if parallel is not None and parallel.activation_checkpointing:
                if getattr(component, "_supports_gradient_checkpointing", False):
                    component.enable_gradient_checkpointing()
                else:
                    apply_activation_checkpointing(component)
            if parallel is not None and getattr(parallel, "enable_compile", False):
                component.compile()
        dtype = upstream.compute_dtype(ctx.cfg)
        sharded = ctx.world_size > 1 and any(parse_entry(scheme.get(n, {})).get("strategy") == "fsdp2"
                                             for n in model.trainable_components)
        if dtype is not None and not sharded:
            model.autocast_dtype = parse_dtype(dtype, "model.compute_dtype")

    def prepare_micro_batch(self, last: bool) -> None:
        """fsdp.defer_fsdp_grad_sync: FSDP2 reduces the trained components' gradients after the last micro-batch."""
        fsdp = upstream.given(self.cfg, "fsdp")
        if fsdp is None or not fsdp.defer_fsdp_grad_sync:
            return
        for component in unwrap(self.model).components.values():
            if hasattr(component, "set_requires_gradient_sync"):
                component.set_requires_gradient_sync(last)

    @property
    def pipeline(self) -> Any:
        """The whole diffusers pipeline (frozen components included) of the model being trained."""
        return unwrap(self.model).pipeline

    @property
    def frozen_base(self) -> Path:
        return Path(self.cfg.checkpoint.checkpoint_dir) / FROZEN_BASE

    def write_frozen_base(self, model: AutoDiffusionPipeline) -> None:
        """The frozen components, tokenizers, scheduler and model_index.json, saved once for every checkpoint.

        Written aside and swapped in whole: checkpoints hold hard links to the files, never modified in place.
        """
        if not (self.cfg.checkpoint.enabled and self.is_main_process) or self.cfg.peft is not None \
                or model.transformer_only:
            return  # with LoRA a checkpoint holds the adapter only; a transformer loaded alone, itself only
        base = self.frozen_base
        staging = base.with_name(f".incomplete-{FROZEN_BASE}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name, component in model.pipeline.components.items():
            if component is not None and name not in model.trainable_components:
                save_component(component, staging / name)
        model.pipeline.save_config(str(staging))
        old = base.with_name(f".incomplete-old-{FROZEN_BASE}-{os.getpid()}")
        if base.exists():
            os.replace(base, old)
        os.replace(staging, base)
        shutil.rmtree(old, ignore_errors=True)

    # ---- weights: diffusers layout ---------------------------------------------------------------------------

    def save_model(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``model/`` is a whole diffusers pipeline: frozen parts linked from ``pipeline_base``, trained ones fresh;
        with LoRA only the denoiser's adapter, in diffusers' LoRA format (``lora.save_lora``)."""
        model = unwrap(self.model)
        directory.mkdir(parents=True, exist_ok=True)
        if has_lora(model):
            save_lora(model, directory, state_dict)
            return
        if model.transformer_only:
            save_component(model.pipeline.scheduler, directory / "scheduler")
        elif self.frozen_base.is_dir():
            _link_tree(self.frozen_base, directory)
        else:
            for name, component in model.pipeline.components.items():
                if component is not None and name not in model.trainable_components:
                    save_component(component, directory / name)
            model.pipeline.save_config(str(directory))
        for name in model.trainable_components:
            component = unwrap(model.components[name])
            prefix = f"components.{name}."
            own = None if state_dict is None else \
                {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
            save_component(component, directory / name, own)

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        """Every component saved under ``directory`` (trained ones must be there; frozen ones are when the
        checkpoint is a whole pipeline, which makes a resumed run independent of how they were initialised)."""
        model = unwrap(model)
        if has_lora(model):
            load_lora(model, directory)
            return
        for name in model.trainable_components:
            sub = directory / name
            if not sub.is_dir():
                lora = " (it holds a LoRA adapter: add the peft: section of the run that wrote it)" \
                    if (directory / LORA_WEIGHTS).is_file() else ""
                raise CheckpointError(f"restore_from.path: '{directory}' has no '{name}' folder; it is not a "
                                      f"checkpoint of this pipeline{lora}")
            load_weights_into(unwrap(model.components[name]), load_safetensors_dir(sub), sub)
        self.load_frozen_components(model, directory)

    def load_frozen_components(self, model: AutoDiffusionPipeline, directory: Path) -> None:
        for name, component in model.frozen_components().items():
            sub = directory / name
            if sub.is_dir() and any(sub.glob("*.safetensors")):
                load_weights_into(component, saved_weights(component, sub), sub)


    # ---- the loss ----------------------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The micro-batch's per-image losses, summed (the engine divides by the images of the whole step)."""
        losses = model(batch.get("pixel_values"), batch["captions"], generator=self.loss_generator,
                       cached=batch.get("cached"), source_images=batch.get("source_images"),
                       source_sizes=batch.get("source_sizes"))
        if self.cfg.performance.check_loss:
            mean = float(losses.detach().mean())
            if upstream.exploded(mean):
                raise AutomodelError(f"performance.check_loss: a micro-batch's loss is {mean} (NaN or above 100): "
                                     "the loss exploded; lower optimizer.lr or set clip_grad_norm.max_norm")
        return losses.sum()

    def count_label_tokens(self, batch: dict[str, Any]) -> int:
        return len(batch["captions"])

    def count_input_tokens(self, batch: dict[str, Any]) -> int:
        return len(batch["captions"])  # tps counts images per second

    # ---- validation: a fixed-noise loss, and sample images -----------------------------------------------------

    def validate(self) -> None:
        """Validation losses with fixed noise (comparable across steps; the training RNG is left untouched)."""
        self.loss_generator = torch.Generator().manual_seed(self.cfg.rng.seed)
        try:
            super().validate()
        finally:
            self.loss_generator = None
        self.write_samples()

    def after_step(self, step: int, tokens: int, seconds: float) -> None:
        for line in upstream.sigma_lines(step, unwrap(self.model).objective, upstream.given(self.cfg, "flow_matching")):
            self.log(line)
        if not self.val_dataloaders and self.step_scheduler.is_val_step():
            self.write_samples()  # no validation data: the engine does not validate, but samples still come

    def sample_prompts(self) -> list[str]:
        settings = self.cfg.sample_generation
        if settings.prompts:
            return list(settings.prompts)
        loaders = [*self.val_dataloaders.values()]
        datasets = [loader.dataset for loader in loaders] + [self.train_dataset]
        for dataset in datasets:
            captions = getattr(dataset, "captions", None)
            if captions:
                return list(dict.fromkeys(captions))[:4]
        return ["a photo"]

    def sample_size(self) -> tuple[int | None, int | None]:
        settings = self.cfg.sample_generation
        resolution = getattr(self.train_dataset, "resolution", None)  # a side, or (height, width)
        height, width = resolution if isinstance(resolution, tuple) else (resolution, resolution)
        return settings.height or height, settings.width or width

    @torch.no_grad()
    def write_samples(self) -> Path | None:
        """A PNG grid (columns: prompts, rows: seeds) in ``<checkpoint_dir>/samples/step_<S>.png``; for a video
        pipeline an animated WebP of such grids, ``step_<S>.webp``, of the training clips' frame count."""
        settings = self.cfg.sample_generation
        model = unwrap(self.model)
        if settings is None or not settings.enabled or model.transformer_only:
            return None  # a transformer loaded alone cannot sample (validation refuses enabling it)
        prompts = self.sample_prompts()
        height, width = self.sample_size()
        extra = call_kwargs(model.pipeline, max_sequence_length=model.max_sequence_length,
                            num_frames=getattr(self.train_dataset, "num_frames", None),
                            frame_rate=getattr(model.conditioning, "fps", None))  # LTX-2: the trained frame rate
        draw = partial(sample_images, model.pipeline, prompts)
        if model.conditioning.edits:
            if settings.prompts:
                raise AutomodelError("sample_generation.prompts: an image-editing pipeline samples the first edits "
                                     "of the training data (each needs its source images); remove prompts")
            edits = self.train_dataset.edits(4)
            prompts, draw = [prompt for prompt, _ in edits], partial(sample_edits, model.pipeline, edits)
        self.model.eval()
        try:
            with model.experts_on(next(model.denoiser.parameters()).device):
                images = draw(settings.num_images_per_prompt, settings.seed, settings.num_inference_steps,
                              settings.guidance_scale, height, width, **extra)
        finally:
            self.model.train()
        if not self.is_main_process:
            return None
        video = isinstance(images[0], list)
        name = f"step_{self.step_scheduler.step}.{'webp' if video else 'png'}"
        path = Path(self.cfg.checkpoint.checkpoint_dir) / "samples" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        grid = {"rows": settings.num_images_per_prompt, "columns": len(prompts)}
        if video:
            save_video([image_grid([clip[f] for clip in images], **grid) for f in range(len(images[0]))], path,
                       DEFAULT_FPS)
        else:
            image_grid(images, **grid).save(path)
        self.log(f"samples [{len(prompts)} prompts x {settings.num_images_per_prompt}] step "
                 f"{self.step_scheduler.step}: {path}")
        return path

    # ---- after training ----------------------------------------------------------------------------------------

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is None:
            return
        model = unwrap(self.model)
        model_dir = final_checkpoint / "model"
        if has_lora(model):
            source = model_source(self.cfg.model)
            base = f"'{source[0]}'" if source is not None else "<the base pipeline>"
            load = f"load_lora_weights('{model_dir}')" if hasattr(model.pipeline, "load_lora_weights") else \
                f"{model.denoiser_name}.load_lora_adapter('{model_dir}', prefix='{model.denoiser_name}', " \
                f"weight_name='{LORA_WEIGHTS}')"
            self.log(f"Trained LoRA adapter of the {model.denoiser_name} in {model_dir} (diffusers' LoRA format): "
                     f"diffusers.{type(model.pipeline).__name__}.from_pretrained({base}).{load}")
            return
        if model.transformer_only:
            cls = model_class(unwrap(model.denoiser))
            self.log(f"Trained transformer in {model_dir / model.denoiser_name} (diffusers layout): "
                     f"diffusers.{cls.__name__}.from_pretrained('{model_dir / model.denoiser_name}'). It was trained "
                     "without the VAE and text encoders; generate diffusion needs the full pipeline: give it the "
                     f"pipeline and this checkpoint (model.pretrained_model_name_or_path: <the pipeline>, "
                     f"model.checkpoint: '{final_checkpoint}')")
            return
        trained = ", ".join(f"{model_class(unwrap(model.components[n])).__module__.split('.')[0]}."
                            f"{model_class(unwrap(model.components[n])).__name__}.from_pretrained('{model_dir / n}')"
                            for n in model.trainable_components)
        hint = f" (sample with max_sequence_length={model.max_sequence_length})" if model.max_sequence_length else ""
        self.log(f"Trained pipeline in {model_dir}: load it with diffusers.DiffusionPipeline.from_pretrained("
                 f"'{model_dir}'){hint}; the trained component alone: {trained}")
