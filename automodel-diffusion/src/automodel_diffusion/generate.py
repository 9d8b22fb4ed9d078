"""``automodel generate diffusion``: images or videos from a diffusers pipeline (or a trained checkpoint), upstream's
schema.

The config is upstream's generation config (its ``examples/diffusion/generate/configs``): ``model``
(the pipeline and an optional training ``checkpoint``), ``inference`` (prompts and the pipeline call's
settings), ``output`` (where the files go, a video's ``fps``), ``vae`` (slicing, tiling), ``seed``. Prompt ``i`` is
drawn with a CPU generator seeded ``seed + i`` and written as ``<output_dir>/sample_<iii>_<prompt>.png``; a video
pipeline's (WanPipeline) as ``.webp``, an animated WebP at ``output.fps`` (Pillow writes it; no mp4 encoder is used);
an audio-video pipeline's (LTX2Pipeline) audio track beside it as ``.wav`` (16-bit PCM at ``output.audio_sample_rate``,
by default the vocoder's rate; no muxer is used).
An image-editing or image-to-image pipeline (QwenImageEditPipeline, StableDiffusion3Img2ImgPipeline, ...) gets
prompt ``i``'s source image, ``inference.input_images[i]``, as its ``image`` argument, as upstream pairs them. A
two-transformer WanPipeline (Wan 2.2 A14B) takes ``model.checkpoint_high_noise`` / ``checkpoint_low_noise``, each the
checkpoint of one stage's training run, whose expert replaces the pipeline's; the pipeline's own sampling switches
between the experts at its ``boundary_ratio``.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from automodel.config import Config, FieldErrors, Free
from automodel.errors import AutomodelError, ConfigIssue
from automodel.recipe import BaseRecipe
from automodel_diffusion.stages import EXPERTS, TWO_EXPERTS, has_two_experts
from automodel_diffusion.upstream import GPU_ONLY

if TYPE_CHECKING:
    from PIL.Image import Image

VIDEO_ONLY = "applies to video pipelines (those whose __call__ takes num_frames, e.g. WanPipeline)"
# the stage checkpoint keys -> the expert of a two-transformer WanPipeline each replaces
STAGE_CHECKPOINTS = {f"checkpoint_{stage}": expert for stage, expert in EXPERTS.items()}
ONE_EXPERT = f"applies to {TWO_EXPERTS}"
IMAGE_INPUT = ("applies to image-editing / image-to-image pipelines only (those whose __call__ takes image, e.g. "
               "QwenImageEditPipeline, StableDiffusion3Img2ImgPipeline)")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class GenerateModelConfig:
    pretrained_model_name_or_path: str = field(metadata=_help("the diffusers pipeline: a hub name or directory"))
    checkpoint: str | None = field(default=None, metadata=_help(
        "a training checkpoint (epoch_<E>_step_<S>, or its model/ folder): its trained components replace the "
        "pipeline's"))
    lora_weights: str | None = field(default=None, metadata=_help(
        "a LoRA adapter in diffusers' format (a LoRA training checkpoint, epoch_<E>_step_<S> or its model/ folder, "
        "or a pytorch_lora_weights.safetensors): loaded with the pipeline's load_lora_weights (a pipeline without "
        "it, HunyuanVideo 1.5: its denoiser's load_lora_adapter)"))
    lora_scale: float = field(default=1.0, metadata=_help("the LoRA adapter's weight (with lora_weights)"))
    lora_adapter_name: str = field(default="default", metadata=_help("the adapter's name (with lora_weights)"))
    checkpoint_high_noise: str | None = field(default=None, metadata=_help(
        "a two-transformer WanPipeline (Wan 2.2 A14B): a training checkpoint of its high_noise stage, whose "
        "transformer replaces the pipeline's (the high-noise expert)"))
    checkpoint_low_noise: str | None = field(default=None, metadata=_help(
        "a two-transformer WanPipeline (Wan 2.2 A14B): a training checkpoint of its low_noise stage, whose "
        "transformer_2 replaces the pipeline's (the low-noise expert)"))

    def __post_init__(self) -> None:
        bad = {}
        if self.lora_scale != 1.0 and self.lora_weights is None:
            bad["lora_scale"] = "applies to lora_weights only; remove it"
        if self.lora_adapter_name != "default" and self.lora_weights is None:
            bad["lora_adapter_name"] = "applies to lora_weights only; remove it"
        for name in ("checkpoint_high_noise", "checkpoint_low_noise"):
            if getattr(self, name) is not None and self.checkpoint is not None:
                bad[name] = ("give either checkpoint (every trained component of one run) or the stage checkpoints "
                             "(checkpoint_high_noise / checkpoint_low_noise), not both")
        for name in ("checkpoint", "lora_weights", "checkpoint_high_noise", "checkpoint_low_noise"):
            path = getattr(self, name)
            if path is not None and name not in bad and not Path(path).exists():
                bad[name] = (f"'{path}' does not exist (relative paths are read from the working directory, "
                             f"{Path.cwd()}); give a training checkpoint of this machine")
        if bad:
            raise FieldErrors(bad)


@dataclass
class InferenceConfig:
    prompts: list[str] = field(metadata=_help("the prompts, one image each"))
    num_inference_steps: int | None = field(default=None, metadata=_help("denoising steps (null: the pipeline's)"))
    guidance_scale: float | None = field(default=None, metadata=_help("classifier-free guidance (null: the "
                                                                      "pipeline's)"))
    height: int | None = field(default=None, metadata=_help("image height (null: the pipeline's)"))
    width: int | None = field(default=None, metadata=_help("image width (null: the pipeline's)"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="bfloat16", metadata=_help(
        "the pipeline's dtype (float16 needs a GPU)"))
    max_samples: int | None = field(default=None, metadata=_help("generate for the first N prompts only"))
    pipeline_kwargs: dict = field(default_factory=dict, metadata=_help(
        "more arguments of the pipeline's __call__ (negative_prompt, max_sequence_length, ...)"))
    input_images: list[str] | None = field(default=None, metadata=_help(
        "source images of an image-editing / image-to-image pipeline, one per prompt (paths relative to the working "
        "directory): each is read as RGB and passed as the pipeline's image"))

    def __post_init__(self) -> None:
        bad = {}
        if not self.prompts:
            bad["prompts"] = "at least one prompt is needed"
        for name in ("num_inference_steps", "height", "width", "max_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad[name] = f"must be >= 1, found {getattr(self, name)}"
        if self.input_images is not None and len(self.input_images) != len(self.prompts):
            bad["input_images"] = (f"one image per prompt: found {len(self.input_images)} for {len(self.prompts)} "
                                   "prompts; give as many images as prompts")
        if "image" in self.pipeline_kwargs or "generator" in self.pipeline_kwargs:
            bad["pipeline_kwargs"] = ("'image' and 'generator' are not pipeline_kwargs here: the image comes from "
                                      "inference.input_images, the generator is seeded per prompt")
        if bad:
            raise FieldErrors(bad)


@dataclass
class OutputConfig:
    output_dir: str = field(default="./inference_outputs", metadata=_help(
        "where the PNG images (a video pipeline: animated WebP videos) are written"))
    fps: float | None = field(default=None, metadata=_help(
        "video frame rate (null: 16); each frame is shown round(1000 / fps) ms: " + VIDEO_ONLY))
    audio_sample_rate: int | None = field(default=None, metadata=_help(
        "an audio-video pipeline's (LTX2Pipeline) audio track, written as a 16-bit WAV beside each video, at this "
        "sample rate (null: the vocoder's output_sampling_rate); refused for a pipeline without audio"))

    def __post_init__(self) -> None:
        bad = {}
        if self.fps is not None and self.fps <= 0:
            bad["fps"] = f"must be > 0, found {self.fps}"
        if self.audio_sample_rate is not None and self.audio_sample_rate < 1:
            bad["audio_sample_rate"] = f"must be >= 1 (Hz), found {self.audio_sample_rate}"
        if bad:
            raise FieldErrors(bad)


@dataclass
class VaeConfig:
    enable_slicing: bool = field(default=False, metadata=_help("decode a batch one image at a time (less memory)"))
    enable_tiling: bool = field(default=False, metadata=_help("decode in overlapping tiles (large images)"))
    enable_cpu_offload: bool = field(default=False, metadata=_help("model CPU offload: needs a GPU"))

    def __post_init__(self) -> None:
        if self.enable_cpu_offload:
            raise FieldErrors({"enable_cpu_offload": f"true is not supported: offloading the pipeline to the CPU "
                                                     f"between its stages {GPU_ONLY}; remove it"})


def load_image(path: str) -> Image:
    """The source image at ``path`` (relative to the working directory) in RGB; unreadable: an error naming it."""
    from PIL import Image, UnidentifiedImageError

    if "://" in path:
        raise AutomodelError(f"inference.input_images: '{path}' is a URL, which is not fetched here; download it "
                             "and give the file's path")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise AutomodelError(f"inference.input_images: '{path}' does not exist (relative paths are read from the "
                             f"working directory, {Path.cwd()})") from None
    except (OSError, UnidentifiedImageError) as err:
        raise AutomodelError(f"inference.input_images: '{path}' is not a readable image: {err}") from None


def takes_image(pipeline_cls: type) -> bool:
    """Whether a diffusers pipeline's ``__call__`` takes a source ``image`` (image editing, image-to-image)."""
    return "image" in inspect.signature(pipeline_cls.__call__).parameters


def image_issues(cfg: Config) -> list[ConfigIssue]:
    """``inference.input_images``: each file readable, and a local pipeline directory's class (its
    model_index.json) one that takes an image; a hub pipeline is checked once loaded."""
    from automodel_diffusion.pipeline import read_model_index

    issues = []
    for path in cfg.inference.input_images:
        try:
            load_image(path)
        except AutomodelError as err:
            issues.append(ConfigIssue("inference.input_images", str(err).removeprefix("inference.input_images: ")))
    source = cfg.model.pretrained_model_name_or_path if cfg.model is not None else None
    index = read_model_index(source) if source else None
    if index is None:
        return issues
    import diffusers

    pipeline_cls = getattr(diffusers, str(index.get("_class_name")), None)
    if isinstance(pipeline_cls, type) and not takes_image(pipeline_cls):
        issues.append(ConfigIssue("inference.input_images", f"{IMAGE_INPUT}; '{source}' is a "
                                                             f"{pipeline_cls.__name__}: remove it"))
    return issues


def stage_checkpoint_issues(model: GenerateModelConfig) -> list[ConfigIssue]:
    """A stage checkpoint on a local pipeline directory with one denoiser (a hub pipeline is checked once loaded)."""
    from automodel_diffusion.pipeline import read_model_index

    keys = [key for key in STAGE_CHECKPOINTS if getattr(model, key) is not None]
    index = read_model_index(model.pretrained_model_name_or_path) if keys else None
    if index is None or has_two_experts(index):
        return []
    return [ConfigIssue(f"model.{key}", f"{ONE_EXPERT}; '{model.pretrained_model_name_or_path}' is a "
                                        f"{index.get('_class_name')} with one denoiser: use model.checkpoint")
            for key in keys]


def sample_name(index: int, prompt: str, suffix: str = "png") -> str:
    """``sample_<iii>_<the prompt's first 50 letters, digits, spaces, _ and ->.<suffix>`` (spaces as _)."""
    safe = re.sub(r"[^A-Za-z0-9 _-]", "", prompt)[:50].strip().replace(" ", "_")
    return f"sample_{index:03d}_{safe}.{suffix}"


class GenerateRecipe(BaseRecipe):
    """Generate one image (or video) per prompt with a diffusers pipeline, optionally with a trained checkpoint's
    weights."""

    sections = {
        "model": GenerateModelConfig,
        "inference": InferenceConfig,
        "output": OutputConfig,
        "vae": VaeConfig,
        "distributed": Free("upstream's multi-GPU generation: only null (generation runs in one process)"),
        "seed": Free("an integer: prompt i is drawn with seed + i (default 42)"),
    }

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = []
        if cfg.resolved.get("distributed") is not None:
            issues.append(ConfigIssue("distributed", "only null: generation runs in one process here"))
        seed = cfg.resolved.get("seed", 42)
        if not isinstance(seed, int) or isinstance(seed, bool):
            issues.append(ConfigIssue("seed", f"expected an integer, found {seed!r}"))
        if cfg.inference is not None and cfg.inference.input_images is not None:
            issues += image_issues(cfg)
        if cfg.model is not None:
            issues += stage_checkpoint_issues(cfg.model)
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        inference = cfg.inference
        prompts = inference.prompts[: inference.max_samples or None]
        edits = "" if inference.input_images is None else ", each edited from its inference.input_images entry"
        return [*super().describe_plan(cfg), f"pipeline: {cfg.model.pretrained_model_name_or_path}",
                f"images: {len(prompts)} into {cfg.output.output_dir}{edits}"]

    def log(self, message: str) -> None:
        import sys

        print(message, file=sys.stderr, flush=True)

    def setup(self) -> None:
        from automodel.model_files import parse_dtype
        from automodel_diffusion.pipeline import load_pipeline

        dtype = parse_dtype(self.cfg.inference.dtype, "inference.dtype")
        self.pipeline = load_pipeline(self.cfg.model.pretrained_model_name_or_path, dtype)
        if self.cfg.model.checkpoint:
            self.load_checkpoint(Path(self.cfg.model.checkpoint), dtype)
        for key, name in STAGE_CHECKPOINTS.items():
            if getattr(self.cfg.model, key):
                self.load_expert(key, name, Path(getattr(self.cfg.model, key)), dtype)
        if self.cfg.model.lora_weights:
            self.load_lora(Path(self.cfg.model.lora_weights))
        vae = self.cfg.vae
        if vae.enable_slicing:
            self.pipeline.vae.enable_slicing()
        if vae.enable_tiling:
            self.pipeline.vae.enable_tiling()
        self.pipeline.set_progress_bar_config(disable=True)
        self.call_settings = self.pipeline_arguments()
        video = "num_frames" in inspect.signature(type(self.pipeline).__call__).parameters
        if self.cfg.output.fps is not None and not video:
            raise AutomodelError(f"output.fps: {VIDEO_ONLY}; this {type(self.pipeline).__name__} makes images: "
                                 "remove it")
        if self.cfg.output.audio_sample_rate is not None and self.audio_rate() is None:
            raise AutomodelError(f"output.audio_sample_rate: applies to audio-video pipelines (those with a vocoder, "
                                 f"e.g. LTX2Pipeline); this {type(self.pipeline).__name__} makes no audio: remove it")
        if self.cfg.inference.input_images is not None and not takes_image(type(self.pipeline)):
            raise AutomodelError(f"inference.input_images: {IMAGE_INPUT}; this is a {type(self.pipeline).__name__}: "
                                 "remove it")

    def load_checkpoint(self, path: Path, dtype: Any) -> None:
        """Each denoiser of a training checkpoint (``model/<component>``; a two-transformer pipeline's: both
        experts, one trained, the other as the run kept it) replaces the pipeline's."""
        from automodel_diffusion.pipeline import DENOISERS

        model_dir = path / "model" if (path / "model").is_dir() else path
        found = [name for name in (*DENOISERS, "transformer_2") if (model_dir / name / "config.json").is_file()
                 and getattr(self.pipeline, name, None) is not None]
        if not found:
            raise AutomodelError(f"model.checkpoint: '{path}' holds no {' or '.join(DENOISERS)} folder of this "
                                 "pipeline; give a checkpoint of this pipeline (epoch_<E>_step_<S> or its model/)")
        for name in found:
            self.replace_component("model.checkpoint", name, model_dir / name, dtype)

    def load_expert(self, key: str, name: str, path: Path, dtype: Any) -> None:
        """A stage checkpoint's expert (``model/<name>``) replaces the two-transformer pipeline's ``name``."""
        if getattr(self.pipeline, "transformer_2", None) is None:
            raise AutomodelError(f"model.{key}: {ONE_EXPERT}; this {type(self.pipeline).__name__} has one denoiser: "
                                 "use model.checkpoint")
        model_dir = path / "model" if (path / "model").is_dir() else path
        if not (model_dir / name / "config.json").is_file():
            raise AutomodelError(f"model.{key}: '{path}' holds no {name} folder; give a checkpoint "
                                 "(epoch_<E>_step_<S> or its model/) of a run with model.stage "
                                 f"{key.removeprefix('checkpoint_')}")
        self.replace_component(f"model.{key}", name, model_dir / name, dtype)

    def replace_component(self, key: str, name: str, directory: Path, dtype: Any) -> None:
        """The pipeline's diffusers model ``name`` replaced by the one saved in ``directory``."""
        import diffusers

        cls = type(getattr(self.pipeline, name))
        if not issubclass(cls, diffusers.ModelMixin):
            raise AutomodelError(f"{key}: the pipeline's '{name}' is a {cls.__name__}, not a diffusers model")
        self.pipeline.register_modules(**{name: cls.from_pretrained(str(directory), torch_dtype=dtype)})
        self.log(f"{key}: {name} from {directory}")

    def load_lora(self, path: Path) -> None:
        """A LoRA adapter (diffusers' format, as diffusion LoRA training writes it) on the pipeline, weighted
        ``lora_scale``."""
        from automodel_diffusion.lora import LORA_WEIGHTS
        from automodel_diffusion.pipeline import DENOISERS

        model = self.cfg.model
        if path.is_dir() and (path / "model" / LORA_WEIGHTS).is_file():
            path = path / "model"
        slot = next((n for n in DENOISERS if getattr(self.pipeline, n, None) is not None), None)
        own = hasattr(self.pipeline, "load_lora_weights")
        # a pipeline without LoRA loaders (HunyuanVideo 1.5): its denoiser loads the layers saved under its name
        target = self.pipeline if own else getattr(self.pipeline, slot or "", None)
        if not hasattr(target, "load_lora_weights" if own else "load_lora_adapter"):
            raise AutomodelError(f"model.lora_weights: {type(self.pipeline).__name__} does not load LoRA adapters")
        if not (path / LORA_WEIGHTS).is_file() and not path.is_file():
            raise AutomodelError(f"model.lora_weights: '{path}' holds no {LORA_WEIGHTS}; give a LoRA training "
                                 "checkpoint (epoch_<E>_step_<S> or its model/) or the adapter file")
        folder, name = (path.parent, path.name) if path.is_file() else (path, LORA_WEIGHTS)
        try:
            if own:
                target.load_lora_weights(str(folder), weight_name=name, adapter_name=model.lora_adapter_name)
            else:
                target.load_lora_adapter(str(folder), weight_name=name, adapter_name=model.lora_adapter_name,
                                         prefix=slot)
        except (ValueError, KeyError, RuntimeError) as err:
            raise AutomodelError(f"model.lora_weights: the adapter in '{path}' does not fit this "
                                 f"{type(self.pipeline).__name__}: {err}") from None
        target.set_adapters([model.lora_adapter_name], [model.lora_scale])
        self.log(f"model.lora_weights: {model.lora_adapter_name} from {path} (scale {model.lora_scale:g})")

    def audio_rate(self) -> int | None:
        """The sample rate audio is written at (None: the pipeline makes no audio)."""
        vocoder = getattr(self.pipeline, "vocoder", None)
        if vocoder is None:
            return None
        return self.cfg.output.audio_sample_rate or int(vocoder.config.output_sampling_rate)

    def pipeline_arguments(self) -> dict[str, Any]:
        """The pipeline call's arguments; one its __call__ does not take is an error naming the key. A
        guidance_scale for a pipeline guided by its ``guider`` component (HunyuanVideo 1.5) sets that guider's."""
        from automodel_diffusion.sampling import takes_guidance_scale, use_guidance_scale

        inference = self.cfg.inference
        settings = {k: getattr(inference, k) for k in ("num_inference_steps", "guidance_scale", "height", "width")
                    if getattr(inference, k) is not None}
        if "guidance_scale" in settings and not takes_guidance_scale(self.pipeline) \
                and getattr(self.pipeline, "guider", None) is not None:
            use_guidance_scale(self.pipeline, settings.pop("guidance_scale"))
        settings.update(inference.pipeline_kwargs)
        params = inspect.signature(type(self.pipeline).__call__).parameters
        unknown = [k for k in settings if k not in params]
        if unknown:
            raise AutomodelError(f"inference: {type(self.pipeline).__name__} does not take {', '.join(unknown)} "
                                 f"(it takes: {', '.join(p for p in params if p != 'self')})")
        return settings

    def run_train_validation_loop(self) -> None:
        """One image (or video) per prompt, each written aside and renamed into place."""
        import torch

        from automodel_diffusion.sampling import DEFAULT_FPS, save_audio, save_video

        inference = self.cfg.inference
        seed = self.cfg.resolved.get("seed", 42)
        out = Path(self.cfg.output.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        prompts = inference.prompts[: inference.max_samples or None]
        for index, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(seed + index)
            source = {} if inference.input_images is None else {"image": load_image(inference.input_images[index])}
            with torch.no_grad():
                result = self.pipeline(prompt=prompt, generator=generator, output_type="pil", **source,
                                       **self.call_settings)
            if not hasattr(result, "images") and not hasattr(result, "frames"):
                raise AutomodelError(f"model: {type(self.pipeline).__name__} returns neither images nor video "
                                     "frames; generate diffusion writes those only")
            path = out / sample_name(index, prompt, "png" if hasattr(result, "images") else "webp")
            staging = path.with_name(f".incomplete-{os.getpid()}-{path.name}")
            if hasattr(result, "images"):
                result.images[0].save(staging, format="PNG")
            else:
                save_video(list(result.frames[0]), staging, self.cfg.output.fps or DEFAULT_FPS)
            os.replace(staging, path)
            if getattr(result, "audio", None) is not None:
                sound = path.with_suffix(".wav")
                staging = sound.with_name(f".incomplete-{os.getpid()}-{sound.name}")
                save_audio(result.audio[0], staging, self.audio_rate())
                os.replace(staging, sound)
                self.log(f"[{index + 1}/{len(prompts)}] {sound} (its audio)")
            edited = "" if inference.input_images is None else f" (from {inference.input_images[index]})"
            self.log(f"[{index + 1}/{len(prompts)}] {path}{edited}")
