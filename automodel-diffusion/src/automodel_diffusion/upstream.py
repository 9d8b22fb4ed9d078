"""Upstream NeMo AutoModel's diffusion schema, mapped onto this recipe (what each key does here, or why not).

Upstream's diffusion configs carry no ``_target_`` for the model and describe training with their own sections:

* ``model:`` ``{pretrained_model_name_or_path, mode: finetune | pretrain, torch_dtype, compute_dtype, ...}`` ->
  :func:`load_upstream_pipeline` (the section's default target);
* ``fsdp:`` / ``ddp:`` (one of them): how the trained denoiser is distributed -> a ``parallel_scheme``;
* ``flow_matching:`` -> the ``objective`` (flow matching with upstream's sampling, shift, clamping and weighting);
* ``data.dataloader`` (upstream's text-to-image / text-to-video loaders over a cache) -> a folder of images / clips
  and captions, encoded on the fly (:func:`text_to_image_data`, :func:`text_to_video_data`); ``performance:`` -> the
  loss check.

``model_type`` / ``flow_matching.adapter_type`` ``flux`` (FLUX.1), ``flux2`` (FLUX.2), ``qwen_image`` (Qwen-Image),
``qwen_image_edit`` (Qwen-Image-Edit), ``wan`` / ``simple`` (Wan 2.1), ``ltx2`` (LTX-2) and ``hunyuan``
(HunyuanVideo 1.5) say the pipeline is a FluxPipeline / Flux2Pipeline / QwenImagePipeline /
QwenImageEditPlusPipeline / WanPipeline / LTX2Pipeline / HunyuanVideo15Pipeline, which is checked; ``adapter_kwargs``
set the guidance a FLUX.1 / FLUX.2 transformer is fed (Qwen-Image and Wan transformers take none), LTX-2's frame rate
and audio loss weight and HunyuanVideo's condition inputs. Keys that need what this recipe does not have (other
model families, image-to-video, Transformer Engine, CUDA kernels) are refused at validation with the reason.
Import-light: no torch at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from automodel.config import Config, ConfigNode, FieldErrors
from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel_diffusion import latents
from automodel_diffusion.objectives import ObjectiveConfig

SUPPORTED = ("SD3-style (StableDiffusion3Pipeline), FLUX.1 (FluxPipeline), FLUX.2 (Flux2Pipeline), Qwen-Image "
             "(QwenImagePipeline), Qwen-Image-Edit (QwenImageEditPlusPipeline), Wan 2.1 and 2.2 A14B text-to-video "
             "(WanPipeline), LTX-2 text-to-video with its audio stream (LTX2Pipeline), HunyuanVideo 1.5 text-to-video "
             "(HunyuanVideo15Pipeline) and Stable Diffusion UNet (StableDiffusionPipeline) pipelines")
FLUX, FLUX2, QWEN_IMAGE, WAN, SIMPLE = "flux", "flux2", "qwen_image", "wan", "simple"
QWEN_IMAGE_EDIT, LTX2, HUNYUAN = "qwen_image_edit", "ltx2", "hunyuan"
# upstream's model_type / adapter_type values that act here -> (the family, the pipeline class it must be); upstream's
# "simple" adapter is the one its Wan 2.1 configs name (a transformer fed the noisy latents, timestep and text)
ADAPTERS = {FLUX: ("FLUX.1", "FluxPipeline"), FLUX2: ("FLUX.2", "Flux2Pipeline"),
            QWEN_IMAGE: ("Qwen-Image", "QwenImagePipeline"),
            QWEN_IMAGE_EDIT: ("Qwen-Image-Edit", "QwenImageEditPlusPipeline"), WAN: ("Wan 2.1", "WanPipeline"),
            SIMPLE: ("Wan 2.1", "WanPipeline"), LTX2: ("LTX-2", "LTX2Pipeline"),
            HUNYUAN: ("HunyuanVideo 1.5", "HunyuanVideo15Pipeline")}
ADAPTER_KWARGS = ("guidance_scale", "use_guidance_embeds")  # upstream's flux, flux2 and qwen_image adapter settings
LTX2_KWARGS = ("audio_loss_weight", "fps")  # upstream's ltx2 adapter settings
HUNYUAN_KWARGS = ("use_condition_latents", "default_image_embed_shape")  # upstream's hunyuan adapter settings
VIDEO_FAMILIES = (WAN, LTX2, HUNYUAN)  # upstream's video loader's model_type values that act here
UPSTREAM_FLUX2_GUIDANCE = 3.5  # upstream's flux2 adapter's default guidance_scale (Flux2Pipeline samples with 4)
CPU_ATTENTION = ("native", "_native_math")  # torch's scaled_dot_product_attention: what runs without CUDA kernels
GPU_ONLY = "needs a CUDA GPU, which this machine lacks"


def family_refusal(name: str) -> str:
    return (f"the {name} model family is not implemented for diffusion training here; this recipe trains "
            f"{SUPPORTED}")


def _help(text: str) -> dict:
    return {"help": text}


# ---- model: (no _target_) ---------------------------------------------------------------------------------------

_REFUSED_MODEL_KEYS = {
    "transformer_engine_fp8": "Transformer Engine FP8 " + GPU_ONLY + " (and NVIDIA Transformer Engine)",
    "transformer_engine_linear": "Transformer Engine linear layers " + GPU_ONLY + " (and NVIDIA Transformer Engine)",
    "fuse_qkv_projections": "fused QKV projections are not implemented for training here",
    "compact_fused_qkv_projections": "fused QKV projections are not implemented for training here",
    "optimize_hunyuan_flash_varlen_mask": ("it speeds up HunyuanVideo's masked attention under attention_backend "
                                           "flash_varlen only (CUDA flash-attention varlen kernels), which "
                                           + GPU_ONLY + "; with torch's attention (native) it would change nothing"),
}
_TE_DETAILS = ("transformer_engine_fp8_recipe", "transformer_engine_fp8_amax_history_len",
               "transformer_engine_fp8_amax_compute_algo")


def load_upstream_pipeline(pretrained_model_name_or_path: str, mode: Literal["finetune", "pretrain"] = "finetune",
                           cache_dir: str | None = None, torch_dtype: str | None = None,
                           compute_dtype: str | None = None, attention_backend: str | None = None,
                           pipeline_spec: dict | None = None, model_type: str | None = None,
                           max_sequence_length: int | None = None, trainable_components: list[str] | None = None,
                           seed: int | None = None, transformer_engine_fp8: bool = False,
                           transformer_engine_linear: bool = False, transformer_engine_fp8_recipe: str | None = None,
                           transformer_engine_fp8_amax_history_len: int | None = None,
                           transformer_engine_fp8_amax_compute_algo: str | None = None,
                           fuse_qkv_projections: bool = False, compact_fused_qkv_projections: bool = False,
                           optimize_hunyuan_flash_varlen_mask: bool = False, stage: str | None = None,
                           boundary_ratio: float | None = None) -> Any:
    """Upstream's ``model:`` section: the diffusers pipeline ``pretrained_model_name_or_path`` (hub name or
    directory, ``cache_dir`` its download cache) stored in ``torch_dtype``; ``mode: pretrain`` re-initialises the
    trained denoiser from its config (``pipeline_spec`` names its class and folder) and keeps the other
    components' weights; ``compute_dtype`` is the dtype the denoiser computes in (the recipe applies it);
    ``attention_backend: native`` is torch's scaled-dot-product attention; ``model_type: flux`` / ``flux2`` /
    ``qwen_image`` / ``wan`` says the pipeline is FLUX.1 / FLUX.2 / Qwen-Image / Wan 2.1 (checked against its
    model_index.json at validation, against the built pipeline by the recipe). ``pipeline_spec.load_full_pipeline:
    false`` loads the transformer alone (fresh from its config with ``mode: pretrain``, its weights with
    ``finetune``) with the scheduler, to train on a latent cache (``automodel_diffusion.latents``). ``stage``
    (``high_noise`` / ``low_noise``) and ``boundary_ratio`` train one expert of a two-transformer Wan 2.2 pipeline
    (``automodel_diffusion.stages``). The other keys are accepted only at the values that need nothing this machine
    or recipe lacks (validation refuses the rest, see ``model_issues``)."""
    refused = model_issues({k: v for k, v in locals().items() if v not in (None, False)}, "model")
    import torch

    from automodel_diffusion.pipeline import AutoDiffusionPipeline

    if refused:
        raise AutomodelError("; ".join(str(issue) for issue in refused))
    kwargs = {"cache_dir": cache_dir} if cache_dir else {}
    if pipeline_spec and pipeline_spec.get("load_full_pipeline") is False:
        if seed is not None and mode == "pretrain":
            torch.manual_seed(seed)
        model = AutoDiffusionPipeline.load_transformer_only(
            pretrained_model_name_or_path, pipeline_spec["transformer_cls"], pipeline_spec.get("subfolder",
                                                                                               "transformer"),
            pretrained=mode == "finetune", dtype=torch_dtype, max_sequence_length=max_sequence_length, **kwargs)
        return _finish(model, attention_backend, compute_dtype)
    trained = trainable_components or ([pipeline_spec["subfolder"]] if pipeline_spec else None)
    model = AutoDiffusionPipeline.from_pretrained(pretrained_model_name_or_path, torch_dtype=torch_dtype,
                                                  trainable_components=trained,
                                                  max_sequence_length=max_sequence_length, stage=stage,
                                                  boundary_ratio=boundary_ratio, **kwargs)
    if mode == "pretrain":
        if seed is not None:
            torch.manual_seed(seed)
        for name in model.trainable_components:
            fresh_component(model, name, (pipeline_spec or {}).get("transformer_cls"))
    return _finish(model, attention_backend, compute_dtype)


def _finish(model: Any, attention_backend: str | None, compute_dtype: str | None) -> Any:
    if attention_backend is not None and hasattr(model.denoiser, "set_attention_backend"):
        model.denoiser.set_attention_backend(attention_backend)
    model.compute_dtype = compute_dtype
    return model


def fresh_component(model: Any, name: str, expected_class: str | None) -> None:
    """Replace the trained component ``name`` with a freshly initialised one of the same config (pre-training)."""
    from automodel_diffusion.pipeline import model_class

    current = model.pipeline.components[name]
    cls = model_class(current)
    if expected_class and cls.__name__ != expected_class:
        raise AutomodelError(f"model.pipeline_spec.transformer_cls: '{expected_class}', but the pipeline's '{name}' "
                             f"is a {cls.__name__}")
    fresh = cls.from_config(current.config).to(dtype=current.dtype)
    setattr(model.pipeline, name, fresh)
    model.pipeline.register_modules(**{name: fresh})
    model.components[name] = fresh


def model_issues(model: Any, key: str = "model") -> list[ConfigIssue]:
    """What upstream's ``model:`` keys ask for that cannot act here."""
    issues = []
    for name, reason in _REFUSED_MODEL_KEYS.items():
        if model.get(name):
            issues.append(ConfigIssue(f"{key}.{name}", f"true is not supported: {reason}; remove it or set false"))
    issues += [ConfigIssue(f"{key}.{name}", f"a setting of transformer_engine_fp8, which {GPU_ONLY} (and NVIDIA "
                                            "Transformer Engine); remove it")
               for name in _TE_DETAILS if model.get(name) is not None]
    backend = model.get("attention_backend")
    if backend is not None and backend not in CPU_ATTENTION:
        issues.append(ConfigIssue(f"{key}.attention_backend", f"'{backend}' {GPU_ONLY} (and its kernels); use "
                                                              "native (torch's scaled-dot-product attention) or "
                                                              "remove it"))
    model_type = model.get("model_type")
    if model_type is not None and str(model_type) not in ADAPTERS:
        issues.append(ConfigIssue(f"{key}.model_type", f"'{model_type}': {family_refusal(model_type)}"
                                                       "; remove model_type (the pipeline's own class decides)"))
    elif model_type is not None:
        issues += family_issues(model_type, model.get("pretrained_model_name_or_path"), f"{key}.model_type")
    issues += _dtype_issues(model, key)
    spec = model.get("pipeline_spec")
    if spec is not None:
        issues += _pipeline_spec_issues(spec, model.get("mode", "finetune"), f"{key}.pipeline_spec")
    return issues


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype_issues(model: Any, key: str) -> list[ConfigIssue]:
    return [ConfigIssue(f"{key}.{name}", f"'{model[name]}' is not a dtype we train in (use one of "
                                         f"{', '.join(DTYPE_NAMES)})")
            for name in ("torch_dtype", "compute_dtype") if model.get(name) is not None
            and str(model[name]).removeprefix("torch.") not in DTYPE_NAMES]


def _pipeline_spec_issues(spec: Any, mode: str, key: str) -> list[ConfigIssue]:
    if not isinstance(spec, (dict, ConfigNode)):
        return [ConfigIssue(key, f"expected a mapping {{transformer_cls, subfolder, load_full_pipeline}}, found "
                                 f"{spec!r}")]
    issues = [ConfigIssue(f"{key}.{name}", "unknown key; pipeline_spec accepts: transformer_cls, subfolder, "
                                           "load_full_pipeline, pipeline_cls")
              for name in spec if name not in ("transformer_cls", "subfolder", "load_full_pipeline", "pipeline_cls")]
    alone = spec.get("load_full_pipeline") is False
    if mode != "pretrain" and not alone:
        issues.append(ConfigIssue(key, "applies to mode: pretrain, or with load_full_pipeline: false (finetune "
                                       "loads every weight of the full pipeline); remove it"))
    if alone and not spec.get("transformer_cls"):
        issues.append(ConfigIssue(f"{key}.transformer_cls", "required with load_full_pipeline: false: the diffusers "
                                                             "class of the transformer loaded alone"))
    if spec.get("pipeline_cls") is not None:
        issues.append(ConfigIssue(f"{key}.pipeline_cls", "the pipeline class comes from the model's "
                                                         "model_index.json here; remove it"))
    return issues


# ---- fsdp: / ddp: -------------------------------------------------------------------------------------------


@dataclass
class FsdpSection:
    """Upstream's ``fsdp:``: the trained denoiser is sharded with FSDP2 (the frozen components are replicated)."""

    dp_size: int | Literal["none"] | None = field(default=None, metadata=_help(
        "data-parallel ranks: the number of processes (none/null: all of them); checked when the run starts"))
    dp_replicate_size: int | None = field(default=None, metadata=_help(
        "HSDP: the processes form this many replica groups, each sharding the denoiser over its ranks (null: 1)"))
    tp_size: int = field(default=1, metadata=_help("tensor parallelism: only 1"))
    cp_size: int = field(default=1, metadata=_help("context parallelism: only 1"))
    pp_size: int = field(default=1, metadata=_help("pipeline parallelism: only 1"))
    ep_size: int | None = field(default=None, metadata=_help("expert parallelism: only 1 (or null)"))
    activation_checkpointing: bool = field(default=True, metadata=_help(
        "recompute each denoiser block's activations in backward (upstream's default: true)"))
    cpu_offload: bool = field(default=False, metadata=_help("FSDP2 CPU offload of the shards: needs a GPU"))
    defer_fsdp_grad_sync: bool = field(default=True, metadata=_help(
        "reduce gradients once per step, after the last micro-batch (FSDP2, under torchrun)"))
    enable_compile: bool = field(default=False, metadata=_help("torch.compile the denoiser"))
    enable_fsdp2_prefetch: bool = field(default=True, metadata=_help(
        "FSDP2 prefetches the next blocks' parameters (depths below; under torchrun)"))
    fsdp2_forward_prefetch_depth: int | None = field(default=None, metadata=_help(
        "blocks prefetched ahead in forward (null: FSDP2's implicit one)"))
    fsdp2_backward_prefetch_depth: int | None = field(default=None, metadata=_help(
        "blocks prefetched ahead in backward (null: FSDP2's implicit one)"))
    reduce_dtype: str | None = field(default=None, metadata=_help("gradient reduction dtype (null: float32)"))
    use_hf_tp_plan: bool = field(default=False, metadata=_help("tensor parallelism plan: only false"))
    backend: str | None = field(default=None, metadata=_help("must agree with dist_env.backend, which sets it"))

    def __post_init__(self) -> None:
        bad = {}
        for name in ("tp_size", "cp_size", "pp_size"):
            if getattr(self, name) != 1:
                bad[name] = f"{getattr(self, name)}: only 1 is supported (diffusion here is data-parallel only)"
        if self.ep_size not in (None, 1):
            bad["ep_size"] = f"{self.ep_size}: only 1 (or null) is supported"
        if self.dp_replicate_size is not None and self.dp_replicate_size < 1:
            bad["dp_replicate_size"] = f"must be >= 1, found {self.dp_replicate_size}"
        if self.cpu_offload:
            bad["cpu_offload"] = f"true is not supported: offloading shards to the CPU {GPU_ONLY}"
        if self.use_hf_tp_plan:
            bad["use_hf_tp_plan"] = "true is not supported: tensor parallelism is not implemented for diffusion"
        if isinstance(self.dp_size, int) and self.dp_size < 1:
            bad["dp_size"] = f"must be >= 1, found {self.dp_size}"
        for name in ("fsdp2_forward_prefetch_depth", "fsdp2_backward_prefetch_depth"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad[name] = f"must be >= 1, found {getattr(self, name)}"
        if self.reduce_dtype is not None and self.reduce_dtype not in ("float32", "bfloat16", "float16"):
            bad["reduce_dtype"] = f"expected float32, bfloat16 or float16, found {self.reduce_dtype!r}"
        if bad:
            raise FieldErrors(bad)

    def scheme_entry(self, compute_dtype: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"strategy": "fsdp2"}
        if (self.dp_replicate_size or 1) > 1:
            entry["dp_replicate_size"] = self.dp_replicate_size
        if compute_dtype is not None:
            entry["param_dtype"] = str(compute_dtype).removeprefix("torch.")
        if self.reduce_dtype is not None:
            entry["reduce_dtype"] = self.reduce_dtype
        if self.enable_fsdp2_prefetch:
            for name in ("forward", "backward"):
                depth = getattr(self, f"fsdp2_{name}_prefetch_depth")
                if depth is not None:
                    entry[f"{name}_prefetch_depth"] = depth
        return entry


@dataclass
class DdpSection:
    """Upstream's ``ddp:``: the trained denoiser is replicated and its gradients all-reduced (DDP)."""

    backend: str | None = field(default=None, metadata=_help("must agree with dist_env.backend, which sets it"))
    activation_checkpointing: bool = field(default=False, metadata=_help(
        "recompute each denoiser block's activations in backward"))
    find_unused_parameters: bool = field(default=False, metadata=_help("DDP's find_unused_parameters"))
    broadcast_buffers: bool | None = field(default=None, metadata=_help("DDP's broadcast_buffers"))
    gradient_as_bucket_view: bool | None = field(default=None, metadata=_help("DDP's gradient_as_bucket_view"))
    bucket_cap_mb: float | None = field(default=None, metadata=_help("DDP's bucket_cap_mb"))
    static_graph: bool | None = field(default=None, metadata=_help("DDP's static_graph"))

    def scheme_entry(self) -> dict[str, Any]:
        options = ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view", "bucket_cap_mb",
                   "static_graph")
        return {"strategy": "ddp", **{k: getattr(self, k) for k in options if getattr(self, k) not in (None, False)}}


# ---- flow_matching: ------------------------------------------------------------------------------------------


@dataclass
class FlowMatchingSection:
    """Upstream's ``flow_matching:`` (its defaults) -> the flow-matching ``objective``."""

    adapter_type: str | None = field(default=None, metadata=_help(
        "upstream's model-family adapter: flux (the pipeline must be a FluxPipeline, FLUX.1), flux2 (a "
        "Flux2Pipeline, FLUX.2), qwen_image (a QwenImagePipeline, Qwen-Image), qwen_image_edit (a "
        "QwenImageEditPlusPipeline, Qwen-Image-Edit: trains on image edits), simple (a WanPipeline, Wan 2.1 "
        "text-to-video), ltx2 (an LTX2Pipeline, LTX-2: video and audio streams) or hunyuan (a "
        "HunyuanVideo15Pipeline, HunyuanVideo 1.5); null: the pipeline's own conditioning decides; the other upstream "
        "values name families not implemented here"))
    adapter_kwargs: dict = field(default_factory=dict, metadata=_help(
        "with adapter_type flux / flux2: guidance_scale (the guidance value a guidance-distilled FLUX.1 / FLUX.2 "
        "transformer is fed; default 3.5, as upstream) and use_guidance_embeds (true needs guidance embeddings; "
        "false on a transformer with them still feeds guidance_scale, as upstream does); with qwen_image: "
        "use_guidance_embeds false, and a "
        "guidance_scale other than 1 governs nothing, as upstream (named in a note line: its transformer takes no "
        "guidance value); with ltx2: audio_loss_weight (the audio stream's loss is added with this weight; default "
        "1) and fps (the clips' frame rate: the video positions and the silent audio's duration; default 24); with "
        "hunyuan: use_condition_latents true (the condition latents and mask channel the pipeline feeds) and "
        "default_image_embed_shape [tokens, width] (the zero image embeddings fed; width: the transformer's "
        "image_embed_dim); else (simple and qwen_image_edit included) only {}"))
    timestep_sampling: Literal["uniform", "logit_normal", "lognorm", "mix", "mode", "beta"] = field(
        default="logit_normal", metadata=_help("how sigmas are drawn (see objective.timestep_sampling)"))
    logit_mean: float = field(default=0.0, metadata=_help("logit_normal: mean"))
    logit_std: float = field(default=1.0, metadata=_help("logit_normal: standard deviation"))
    flow_shift: float = field(default=3.0, metadata=_help("sigma shift (objective.shift); also scales linear "
                                                          "loss weights"))
    mix_uniform_ratio: float = field(default=0.1, metadata=_help(
        "probability that a micro-batch draws uniform sigmas instead"))
    beta_alpha: float = field(default=2.5, metadata=_help("beta sampling: alpha"))
    beta_beta: float = field(default=1.5, metadata=_help("beta sampling: beta"))
    use_sigma_noise: bool = field(default=True, metadata=_help(
        "false: sigmas uniform and never shifted (objective.shift_sigmas)"))
    sigma_min: float = field(default=0.0, metadata=_help("sigmas clamped to at least this"))
    sigma_max: float = field(default=1.0, metadata=_help("sigmas clamped to at most this"))
    num_train_timesteps: int = field(default=1000, metadata=_help("the denoiser's timestep is sigma * this"))
    i2v_prob: float = field(default=0.0, metadata=_help(
        "upstream's image-to-video draw (a probability): on a HunyuanVideo 1.5 pipeline a micro-batch of clips is "
        "conditioned on its first latent frame with this probability, as upstream's hunyuan adapter does; other "
        "pipelines train text-conditioned only, as upstream's other adapters (a value above 0 is named in a note "
        "line)"))
    cfg_dropout_prob: float = field(default=0.1, metadata=_help(
        "probability of training a sample without its caption (here: on the empty caption, the unconditional "
        "input the pipeline's classifier-free guidance uses)"))
    use_loss_weighting: bool = field(default=True, metadata=_help("weight each sample's loss by its sigma"))
    loss_weighting_scheme: Literal["linear", "bsmntw"] = field(default="linear", metadata=_help(
        "linear: 1 + flow_shift * sigma; bsmntw: a bell curve over the timesteps"))
    log_interval: int = field(default=100, metadata=_help(
        "every N steps, a detailed line about the step's sigmas (range, mean, std, sampling)"))
    summary_log_interval: int = field(default=10, metadata=_help("every N steps, a one-line sigma summary"))

    def __post_init__(self) -> None:
        bad = {}
        if self.adapter_type is not None and self.adapter_type not in ADAPTERS:
            bad["adapter_type"] = (f"'{self.adapter_type}': {family_refusal(self.adapter_type)}; remove "
                                   "adapter_type and use one of those pipelines")
        if self.adapter_type in (FLUX, FLUX2, QWEN_IMAGE):
            bad.update(adapter_kwargs_issues(self.adapter_type, self.adapter_kwargs))
        elif self.adapter_type == LTX2:
            bad.update(ltx2_kwargs_issues(self.adapter_kwargs))
        elif self.adapter_type == HUNYUAN:
            bad.update(hunyuan_kwargs_issues(self.adapter_kwargs))
        elif self.adapter_kwargs:
            bad["adapter_kwargs"] = ("upstream's adapter settings do not apply here (no adapter, or the simple / "
                                     "qwen_image_edit adapter, which take none); remove them")
        if not 0 <= self.i2v_prob <= 1:
            bad["i2v_prob"] = f"must be a probability (0 to 1), found {self.i2v_prob}"
        for name in ("log_interval", "summary_log_interval"):
            if getattr(self, name) < 1:
                bad[name] = f"must be >= 1, found {getattr(self, name)}"
        if bad:
            raise FieldErrors(bad)
        try:
            self.objective()
        except FieldErrors as err:
            raise FieldErrors({_UPSTREAM_NAMES.get(k, k): v for k, v in err.errors.items()}) from None

    def objective(self) -> ObjectiveConfig:
        weighting = self.loss_weighting_scheme if self.use_loss_weighting else "none"
        return ObjectiveConfig(type="flow_matching", timestep_sampling=self.timestep_sampling,
                               logit_mean=self.logit_mean, logit_std=self.logit_std,
                               mix_uniform_ratio=self.mix_uniform_ratio, beta_alpha=self.beta_alpha,
                               beta_beta=self.beta_beta, shift=self.flow_shift, shift_sigmas=self.use_sigma_noise,
                               sigma_min=self.sigma_min, sigma_max=self.sigma_max,
                               num_train_timesteps=self.num_train_timesteps, loss_weighting=weighting,
                               caption_dropout=self.cfg_dropout_prob)


def adapter_kwargs_issues(adapter: str, kwargs: dict) -> dict[str, str]:
    """Key -> why, for flux / flux2 / qwen_image adapter_kwargs that cannot act (a FLUX.1 / FLUX.2 transformer's own
    check comes at build)."""
    bad = {f"adapter_kwargs.{k}": f"not a setting of the {adapter} adapter here (it takes {', '.join(ADAPTER_KWARGS)})"
           for k in kwargs if k not in ADAPTER_KWARGS}
    scale, use = kwargs.get("guidance_scale"), kwargs.get("use_guidance_embeds")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        bad["adapter_kwargs.guidance_scale"] = f"expected a number > 0, found {scale!r}"
    if use is not None and not isinstance(use, bool):
        bad["adapter_kwargs.use_guidance_embeds"] = f"expected true or false, found {use!r}"
    elif adapter == QWEN_IMAGE and use:
        bad["adapter_kwargs.use_guidance_embeds"] = ("true, but diffusers' Qwen-Image transformer takes no guidance "
                                                     "value (QwenImagePipeline feeds none); set false or remove it")
    return bad


def ltx2_kwargs_issues(kwargs: dict) -> dict[str, str]:
    """Key -> why, for ltx2 adapter_kwargs that cannot act."""
    bad = {f"adapter_kwargs.{k}": f"not a setting of the ltx2 adapter here (it takes {', '.join(LTX2_KWARGS)})"
           for k in kwargs if k not in LTX2_KWARGS}
    weight, fps = kwargs.get("audio_loss_weight"), kwargs.get("fps")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0):
        bad["adapter_kwargs.audio_loss_weight"] = f"expected a number >= 0, found {weight!r}"
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        bad["adapter_kwargs.fps"] = f"expected a frame rate > 0, found {fps!r}"
    return bad


def hunyuan_kwargs_issues(kwargs: dict) -> dict[str, str]:
    """Key -> why, for hunyuan adapter_kwargs that cannot act (the image embeddings' width is checked at build)."""
    bad = {f"adapter_kwargs.{k}": f"not a setting of the hunyuan adapter here (it takes {', '.join(HUNYUAN_KWARGS)})"
           for k in kwargs if k not in HUNYUAN_KWARGS}
    if kwargs.get("use_condition_latents") is not None and kwargs["use_condition_latents"] is not True:
        bad["adapter_kwargs.use_condition_latents"] = (
            f"{kwargs['use_condition_latents']!r}: only true: HunyuanVideo15Pipeline feeds its transformer the noisy "
            "latents with condition latents and their mask channel (its in_channels), so it trains with them; set "
            "true or remove it")
    shape = kwargs.get("default_image_embed_shape")
    if shape is not None and not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        bad["adapter_kwargs.default_image_embed_shape"] = f"expected [tokens, width] (two numbers > 0), found {shape!r}"
    return bad


def family_issues(adapter: str, source: Any, key: str) -> list[ConfigIssue]:
    """A family key (flux, flux2, qwen_image, wan, simple, ltx2, hunyuan) on a local pipeline whose model_index.json
    names another pipeline class."""
    from automodel_diffusion.pipeline import read_model_index

    family, pipeline = ADAPTERS[adapter]
    index = read_model_index(source) if isinstance(source, str) else None
    if index is None or index.get("_class_name") == pipeline:
        return []
    return [ConfigIssue(key, f"'{adapter}' ({family}) needs a {pipeline}, but '{source}' is a "
                             f"{index.get('_class_name')}; remove it or point the model at a {family} pipeline")]


def apply_adapter(cfg: Config, model: Any) -> str | None:
    """At build: the flux / flux2 / qwen_image / wan / simple / ltx2 / hunyuan family keys (and the video loader's
    model_type) need the built pipeline to be of that family; flux's and flux2's adapter_kwargs set its guidance,
    ltx2's its frame rate and audio loss weight, hunyuan's and i2v_prob its condition inputs (the returned note, if
    any, is for the run's log)."""
    from automodel_diffusion.conditioning import (
        Flux2Conditioning,
        FluxConditioning,
        QwenImageConditioning,
        WanConditioning,
    )
    from automodel_diffusion.edit import QwenImageEditConditioning
    from automodel_diffusion.hunyuan import HunyuanConditioning
    from automodel_diffusion.ltx2 import LTX2Conditioning

    settings = given(cfg, "flow_matching")
    built = {FLUX: FluxConditioning, FLUX2: Flux2Conditioning, QWEN_IMAGE: QwenImageConditioning, WAN: WanConditioning,
             SIMPLE: WanConditioning, QWEN_IMAGE_EDIT: QwenImageEditConditioning, LTX2: LTX2Conditioning,
             HUNYUAN: HunyuanConditioning}
    issues = [ConfigIssue(key, f"'{value}' ({ADAPTERS[value][0]}), but the pipeline is a "
                               f"{type(model.pipeline).__name__}; remove it or load a {ADAPTERS[value][1]}")
              for key, value in (("model.model_type", _model_type(cfg)),
                                 ("flow_matching.adapter_type", settings and settings.adapter_type),
                                 ("data.dataloader.model_type", _loader_model_type(cfg)))
              if value in ADAPTERS and type(model.conditioning) is not built[value]]
    if issues:
        raise ConfigError(issues)
    if settings is not None and settings.adapter_type == LTX2:
        model.conditioning.set_streams(**settings.adapter_kwargs)
    if isinstance(model.conditioning, HunyuanConditioning):
        return _apply_hunyuan(settings, model.conditioning)
    if settings is not None and settings.adapter_type in (FLUX, FLUX2):
        kwargs = settings.adapter_kwargs
        default = UPSTREAM_FLUX2_GUIDANCE if settings.adapter_type == FLUX2 else None
        return model.conditioning.set_guidance(kwargs.get("use_guidance_embeds"), kwargs.get("guidance_scale"),
                                               "flow_matching.adapter_kwargs.guidance_scale", default)
    scale = settings.adapter_kwargs.get("guidance_scale") if settings is not None else None
    if type(model.conditioning) is QwenImageConditioning and scale not in (None, 1):
        return (f"note: flow_matching.adapter_kwargs.guidance_scale: {scale} governs nothing in this run: upstream's "
                "qwen_image adapter feeds it only with use_guidance_embeds true, and diffusers' Qwen-Image "
                "transformer takes no guidance value")
    if settings is not None and settings.i2v_prob > 0:
        return (f"note: flow_matching.i2v_prob: {settings.i2v_prob} governs nothing in this run: upstream's draw of "
                "image-to-video batches is read only by its HunyuanVideo adapter (its simple / Wan adapter, and every "
                f"image batch, train text-conditioned as this {type(model.pipeline).__name__} does)")
    return None


def _apply_hunyuan(settings: FlowMatchingSection | None, conditioning: Any) -> None:
    """Upstream's hunyuan adapter settings and i2v_prob on a HunyuanVideo 1.5 pipeline's conditioning."""
    if settings is None:
        return None
    shape = settings.adapter_kwargs.get("default_image_embed_shape")
    if shape is not None:
        conditioning.set_image_embed_shape(shape)
    conditioning.i2v_prob = settings.i2v_prob
    return None


def _loader_model_type(cfg: Config) -> Any:
    data = cfg.get("data") if "data" in cfg else None
    loader = data.get("dataloader") if isinstance(data, ConfigNode) else None
    return loader.get("model_type") if isinstance(loader, ConfigNode) else None


def _model_type(cfg: Config) -> Any:
    model = cfg.model
    return model.get("model_type") if isinstance(model, ConfigNode) and model.target is None else None


_UPSTREAM_NAMES = {"shift": "flow_shift", "caption_dropout": "cfg_dropout_prob", "shift_sigmas": "use_sigma_noise"}


# ---- performance: ----------------------------------------------------------------------------------------------


@dataclass
class PerformanceSection:
    check_loss: bool = field(default=False, metadata=_help(
        "stop the run when a micro-batch's loss is NaN or above 100 (a loss explosion)"))
    grad_clip_foreach: bool = field(default=True, metadata=_help(
        "gradients are clipped with torch's foreach implementation (its default): only true"))

    def __post_init__(self) -> None:
        if not self.grad_clip_foreach:
            raise FieldErrors({"grad_clip_foreach": "false is not supported: the engine clips with torch's foreach "
                                                    "implementation; remove it"})


# ---- data.dataloader: upstream's text-to-image loader over a folder of images -----------------------------------

LOADER_KEYS = ("num_workers", "shuffle", "drop_last", "pin_memory", "prefetch_factor")
VIDEO_LOADERS = ("build_video_multiresolution_dataloader", "text_to_video_data")  # upstream's name, ours
EDIT_LOADERS = ("ImageEditDataloaderConfig", "image_edit_data")


@dataclass
class ImageData:
    """What upstream's loader section describes here: the data set, the loader's settings, and notes for the run's
    log (settings that govern nothing, as upstream)."""

    dataset: Any
    loader: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def text_to_image_data(cache_dir: str, base_resolution: list[int] | None = None, train_text_encoder: bool = False,
                       dynamic_batch_size: bool = False, quantization: int | None = None, seed: int | None = None,
                       num_workers: int = 2, shuffle: bool = True, drop_last: bool = False, pin_memory: bool = False,
                       prefetch_factor: int | None = None) -> ImageData:
    """Upstream's ``build_text_to_image_multiresolution_dataloader`` over ``cache_dir``, which here is a folder of
    images and captions (the ``ImageCaptionDataset`` formats: ``train.jsonl`` / ``metadata.jsonl`` / images with
    ``.txt`` captions) encoded through the pipeline's VAE and text encoders on the fly. Upstream's cache of
    precomputed latents is ``torch.save`` (pickle) files, which are never loaded here. Each image is resized and
    centre-cropped to the square ``base_resolution``; the loader keys are the data loader's, which shuffles with
    the run's seed (``seed`` may only repeat it)."""
    from automodel_diffusion.datasets import ImageCaptionDataset

    problems = text_to_image_issues(locals())
    if problems:
        raise AutomodelError("; ".join(f"data.dataloader.{k}: {v}" for k, v in problems.items()))
    loader = loader_settings(num_workers, shuffle, drop_last, pin_memory, prefetch_factor)
    if latents.is_latent_cache(cache_dir):
        return ImageData(latents.LatentCacheDataset(cache_dir), loader)
    return ImageData(ImageCaptionDataset(cache_dir, resolution=(base_resolution or [512, 512])[0]), loader)


def loader_settings(num_workers: int, shuffle: bool, drop_last: bool, pin_memory: bool,
                    prefetch_factor: int | None) -> dict[str, Any]:
    """Upstream's loader keys as the data loader's settings."""
    loader = {"num_workers": num_workers, "shuffle": shuffle, "drop_last": drop_last, "pin_memory": pin_memory}
    if prefetch_factor is not None:
        loader["prefetch_factor"] = prefetch_factor
    return loader


def text_to_video_data(cache_dir: str, model_type: str = WAN, base_resolution: list[int] | None = None,
                       num_frames: int | None = None, dynamic_batch_size: bool = False, num_workers: int = 2,
                       shuffle: bool = True, drop_last: bool = True, pin_memory: bool = False,
                       prefetch_factor: int | None = None) -> ImageData:
    """Upstream's ``build_video_multiresolution_dataloader`` over ``cache_dir``, which here is a folder of clips and
    captions (the ``VideoCaptionDataset`` formats: animated GIF / WebP files or folders of frame images, with
    ``.txt`` captions or a ``metadata.jsonl``) encoded through the pipeline's VAE and text encoder on the fly;
    upstream's cache of precomputed latents (pickles) is never loaded. Every frame is resized and centre-cropped to
    the square ``base_resolution``; ``num_frames`` (ours: upstream's cache fixes the frames when it is made) takes
    the first frames of each clip (null: every frame; the clips must then be equally long). ``model_type``:
    ``wan``, ``ltx2`` or ``hunyuan`` (the clips are read alike), is the family the pipeline must be (checked at
    build)."""
    from automodel_diffusion.datasets import VideoCaptionDataset

    problems = text_to_video_issues(locals())
    if problems:
        raise AutomodelError("; ".join(f"data.dataloader.{k}: {v}" for k, v in problems.items()))
    loader = loader_settings(num_workers, shuffle, drop_last, pin_memory, prefetch_factor)
    if latents.is_latent_cache(cache_dir):
        return ImageData(latents.LatentCacheDataset(cache_dir), loader)
    resolution = (base_resolution or [512, 512])[0]
    return ImageData(VideoCaptionDataset(cache_dir, resolution=resolution, num_frames=num_frames), loader)


def image_edit_data(cache_dir: str, base_resolution: list[int] | None = None, quantization: int | None = None,
                    dynamic_batch_size: bool = False, seed: int | None = None, num_workers: int = 2,
                    shuffle: bool = True, drop_last: bool = True, pin_memory: bool = False,
                    prefetch_factor: int | None = None) -> ImageData:
    """Upstream's ``ImageEditDataloaderConfig`` over ``cache_dir``, which here is a folder holding upstream's
    image-edit manifest (``hf_image_edit_manifest.jsonl``, what its preprocessing reads: source images, target image
    and instruction per row; ``automodel_diffusion.edit``), encoded through the QwenImageEditPlusPipeline's VAE and
    text encoder on the fly; upstream's cache of precomputed latents (pickles) is never loaded. The images are sized
    as upstream's preprocessing sizes them for its cache: the target and each source keep their aspect ratios within
    ``base_resolution``'s pixels (height x width; sides multiples of 32), and each batch is drawn within one bucket
    of samples whose images share those sizes (``automodel_diffusion.buckets``). The loader keys are the data
    loader's, which shuffles (the buckets, then within each) with the run's seed (``seed`` may only repeat it)."""
    from automodel_diffusion.edit import ImageEditDataset

    problems = image_edit_issues(locals())
    if problems:
        raise AutomodelError("; ".join(f"data.dataloader.{k}: {v}" for k, v in problems.items()))
    loader = loader_settings(num_workers, shuffle, drop_last, pin_memory, prefetch_factor)
    notes = [] if quantization is None else [
        f"note: data.dataloader.quantization: {quantization} governs nothing in this run, as in upstream's: its "
        "image-edit loader reads it only to size dynamic batches, which that loader refuses (the images are sized "
        "within base_resolution's pixels, in multiples of 32)"]
    return ImageData(ImageEditDataset(cache_dir, resolution=list(base_resolution or [512, 512])), loader, notes)


def image_edit_issues(settings: dict[str, Any]) -> dict[str, str]:
    """Key -> why, for upstream image-edit loader settings that cannot act here."""
    bad = text_to_image_issues({**settings, "cache_dir": None, "quantization": None, "base_resolution": None,
                                "dynamic_batch_size": False})
    size = settings.get("base_resolution") or [512, 512]
    if not (isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        bad["base_resolution"] = f"expected [height, width] in pixels, found {size!r}"
    elif size[0] * size[1] < 32 * 32:
        bad["base_resolution"] = (f"{list(size)} is a budget of {size[0] * size[1]} pixels, under one 32x32 image "
                                  "(images are sized in multiples of 32)")
    if settings.get("dynamic_batch_size"):
        bad["dynamic_batch_size"] = ("true is refused, as upstream's image-edit loader refuses it: a batch's cost "
                                     "depends on the target's and every source's size together; use a fixed batch "
                                     "size (step_scheduler.local_batch_size)")
    quantization = settings.get("quantization")
    if quantization is not None and (isinstance(quantization, bool) or not isinstance(quantization, int)
                                     or quantization <= 0):
        bad["quantization"] = f"expected a positive number of pixels, found {quantization!r}"
    cache = settings.get("cache_dir")
    if isinstance(cache, str) and Path(cache).is_dir() and latents.is_pickle_cache(cache):
        bad["cache_dir"] = (f"'{cache}' is upstream's image-edit cache (torch.save files): it is never loaded here, "
                            "because loading it unpickles; point cache_dir at the folder of upstream's image-edit "
                            "manifest (hf_image_edit_manifest.jsonl and its images)")
    elif isinstance(cache, str) and Path(cache).is_dir() and not (Path(cache) / "hf_image_edit_manifest.jsonl"
                                                                   ).is_file():
        bad["cache_dir"] = (f"'{cache}' holds no hf_image_edit_manifest.jsonl (upstream's image-edit manifest: rows "
                            "{id, prompt, media: [{role: target | context | condition, file_name}], metadata})")
    return bad


def text_to_video_issues(settings: dict[str, Any]) -> dict[str, str]:
    """Key -> why, for upstream text-to-video loader settings that cannot act here."""
    bad = {k: v for k, v in text_to_image_issues(settings).items() if k != "cache_dir"}
    model_type = settings.get("model_type", WAN)
    if model_type in ADAPTERS and model_type not in VIDEO_FAMILIES:
        bad["model_type"] = (f"'{model_type}' ({ADAPTERS[model_type][0]}) is not a video family; only wan, ltx2 and "
                             "hunyuan clips are read here (use its own data loader)")
    elif model_type not in VIDEO_FAMILIES:
        bad["model_type"] = (f"'{model_type}': {family_refusal(model_type)}; only wan, ltx2 and hunyuan clips are "
                             "read here")
    frames = settings.get("num_frames")
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        bad["num_frames"] = f"expected a number of frames >= 1, found {frames!r}"
    bad.update(cache_issues(settings, "the clips and captions (animated .gif / .webp files or folders of frames, "
                                      "with .txt captions or a metadata.jsonl)"))
    return bad


def text_to_image_issues(settings: dict[str, Any]) -> dict[str, str]:
    """Key -> why, for upstream text-to-image loader settings that cannot act here."""
    bad = {}
    size = settings.get("base_resolution") or [512, 512]
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) for v in size)):
        bad["base_resolution"] = f"expected [height, width], found {size!r}"
    elif size[0] != size[1]:
        bad["base_resolution"] = (f"{list(size)}: only square resolutions are supported (images are centre-cropped); "
                                  "upstream's aspect-ratio buckets are not implemented")
    if settings.get("quantization") is not None:
        bad["quantization"] = ("upstream rounds its aspect-ratio buckets to this; buckets are not implemented here "
                               "(images are centre-cropped to base_resolution): remove it")
    if settings.get("dynamic_batch_size"):
        bad["dynamic_batch_size"] = "true is not supported: per-bucket batch sizes are not implemented"
    if settings.get("train_text_encoder"):
        bad["train_text_encoder"] = ("true is not supported with upstream's loader here; to train a text encoder "
                                     "name it in model.trainable_components")
    bad.update(cache_issues(settings, "the images and captions (train.jsonl, metadata.jsonl or images with .txt "
                                      "captions)"))
    return bad


def cache_issues(settings: dict[str, Any], sources: str) -> dict[str, str]:
    """What a ``cache_dir`` holding latents asks that cannot act: upstream's pickles; with our latent cache, a
    ``base_resolution`` / ``num_frames`` other than the cache's (its images were encoded at those)."""
    cache = settings.get("cache_dir")
    if not isinstance(cache, str) or not Path(cache).is_dir():
        return {}
    if latents.is_latent_cache(cache):
        try:
            manifest = latents.read_manifest(cache)
        except AutomodelError as err:
            return {"cache_dir": str(err).removeprefix("data.dataloader.cache_dir: ")}
        bad = {}
        size = settings.get("base_resolution")
        if size is not None and list(size) != [manifest.get("resolution")] * 2:
            bad["base_resolution"] = (f"{list(size)}, but the latent cache '{cache}' holds images encoded at "
                                      f"{manifest.get('resolution')}x{manifest.get('resolution')}: set "
                                      f"[{manifest.get('resolution')}, {manifest.get('resolution')}], remove it, or "
                                      "remake the cache")
        frames = settings.get("num_frames")
        if frames is not None and frames != manifest.get("num_frames"):
            bad["num_frames"] = (f"{frames}, but the latent cache '{cache}' holds clips of "
                                 f"{manifest.get('num_frames')} frames: remove it or remake the cache")
        return bad
    if latents.is_pickle_cache(cache):
        return {"cache_dir": f"'{cache}' is upstream's cache of precomputed latents (torch.save files): it is never "
                             f"loaded here, because loading it unpickles; point cache_dir at {sources}, or at a "
                             f"latent cache of safetensors: {latents.HOW_TO_MAKE}"}
    return {}


# ---- the recipe's view: which sections say what -------------------------------------------------------------


def effective_scheme(cfg: Config, trainable: list[str] | None, denoiser: str) -> Any:
    """``parallel_scheme`` as written, or the one ``fsdp:`` / ``ddp:`` describe for the trained components."""
    if cfg.resolved.get("parallel_scheme") is not None:
        return cfg.resolved["parallel_scheme"]
    names = trainable or [denoiser]
    for name in ("fsdp", "ddp"):
        section = given(cfg, name)
        if section is not None:
            entry = section.scheme_entry(compute_dtype(cfg)) if name == "fsdp" else section.scheme_entry()
            return {component: entry for component in names}
    return None


def scheme_unchecked(cfg: Config) -> bool:
    """Whether fsdp: / ddp: is written but failed validation (its own issues say why; no scheme to check)."""
    return any(name in cfg and cfg.get(name) is None for name in ("fsdp", "ddp"))


def given(cfg: Config, name: str) -> Any:
    """A section the config writes (None when absent: an absent keyed section otherwise reads as its defaults)."""
    return cfg.get(name) if name in cfg else None


def compute_dtype(cfg: Config) -> str | None:
    """The upstream ``model.compute_dtype`` when it differs from ``model.torch_dtype`` (None: no mixed precision)."""
    model = cfg.model
    if model is None or model.target is not None:
        return None
    wanted = model.get("compute_dtype")
    stored = model.get("torch_dtype") or "float32"
    return None if wanted is None or str(wanted) == str(stored) else str(wanted)


def upstream_issues(cfg: Config) -> list[ConfigIssue]:
    """Across sections: one place for each setting, and upstream values that cannot act here."""
    issues = []
    schemes = [name for name in ("parallel_scheme", "fsdp", "ddp") if name in cfg]
    if len(schemes) > 1:
        issues.append(ConfigIssue(schemes[1], f"give one of parallel_scheme, fsdp and ddp (found "
                                              f"{', '.join(schemes)})"))
    if "objective" in cfg and "flow_matching" in cfg:
        issues.append(ConfigIssue("flow_matching", "give one of objective and flow_matching (the same settings)"))
    model = cfg.model
    if isinstance(model, ConfigNode) and model.target is None:
        issues += model_issues(model)
    settings = cfg.get("flow_matching") if "flow_matching" in cfg else None
    if settings is not None and settings.adapter_type in ADAPTERS and isinstance(model, ConfigNode):
        source = model.get("pretrained_model_name_or_path") or model.get("config")
        issues += family_issues(settings.adapter_type, source, "flow_matching.adapter_type")
    data = cfg.get("data")
    if data is not None:
        issues += _data_issues(data, cfg.rng.seed)
        if "dataset" in cfg:
            issues.append(ConfigIssue("data", "give one of dataset and data.dataloader (both name training data)"))
    elif "dataset" not in cfg:
        issues.append(ConfigIssue("dataset", "required section is missing: the training images and captions "
                                             "({_target_: automodel_diffusion.datasets.ImageCaptionDataset, path: "
                                             "...}, or upstream's data.dataloader)"))
    backend = cfg.dist_env.backend if cfg.dist_env is not None else None
    for name in ("fsdp", "ddp"):
        section = given(cfg, name)
        if cfg.dist_env is not None and section is not None and section.backend not in (None, backend):
            issues.append(ConfigIssue(f"{name}.backend", f"'{section.backend}' but dist_env.backend is "
                                                         f"{backend!r}: dist_env.backend sets it; remove this or "
                                                         "make them agree"))
    return issues


def _data_issues(data: Any, seed: int) -> list[ConfigIssue]:
    if not isinstance(data, ConfigNode) or set(data) != {"dataloader"} or not isinstance(data["dataloader"],
                                                                                          ConfigNode):
        return [ConfigIssue("data", "expected {dataloader: {_target_: <upstream data loader builder>, ...}}")]
    loader = data["dataloader"]
    settings = {k: v for k, v in loader.to_dict().items() if k != "_target_"}
    name = str(loader.target).rsplit(".", 1)[-1]
    check = (text_to_video_issues if name in VIDEO_LOADERS else image_edit_issues if name in EDIT_LOADERS
             else text_to_image_issues)
    issues = [ConfigIssue(f"data.dataloader.{k}", v) for k, v in check(settings).items()]
    if settings.get("seed") is not None and settings["seed"] != seed:
        issues.append(ConfigIssue("data.dataloader.seed", f"{settings['seed']}: the loader shuffles with the run's "
                                                          f"seed ({seed}) here; remove it or make them agree"))
    return issues


def world_issue(fsdp: FsdpSection | None, world: int) -> ConfigIssue | None:
    """``fsdp.dp_size`` must be the number of processes, as upstream's device mesh requires, and
    ``dp_replicate_size`` divide it (checked at validation against the planned launch, and at start-up)."""
    if fsdp is not None and (fsdp.dp_replicate_size or 1) > 1 and world % fsdp.dp_replicate_size:
        return ConfigIssue("fsdp.dp_replicate_size", f"{fsdp.dp_replicate_size} does not divide this run's {world} "
                           "process(es) (HSDP's replica groups each hold whole shards); launch a multiple of it or "
                           "change it")
    if fsdp is None or not isinstance(fsdp.dp_size, int) or fsdp.dp_size == world:
        return None
    return ConfigIssue("fsdp.dp_size", f"{fsdp.dp_size}, but this run has {world} process(es); set it to {world} (or "
                       f"none), or launch {fsdp.dp_size} processes (--nproc-per-node {fsdp.dp_size})")


def fsdp_world(data: dict[str, Any]) -> int:
    """The fewest processes an upstream ``fsdp:`` section (as written) describes: its ``dp_size``, else its
    ``dp_replicate_size`` (1 without either)."""
    fsdp = data.get("fsdp")
    if not isinstance(fsdp, dict):
        return 1
    for key in ("dp_size", "dp_replicate_size"):
        if isinstance(fsdp.get(key), int) and not isinstance(fsdp[key], bool) and fsdp[key] > 0:
            return fsdp[key]
    return 1


def sigma_lines(step: int, objective: Any, settings: FlowMatchingSection | None) -> list[str]:
    """The flow_matching log lines due after ``step`` (upstream's log_interval / summary_log_interval)."""
    sigmas = getattr(objective, "last_sigmas", None)
    if settings is None or sigmas is None:
        return []
    low, high = float(sigmas.min()), float(sigmas.max())
    if step % settings.log_interval == 0:
        spread = float(sigmas.std()) if sigmas.numel() > 1 else 0.0
        return [f"flow matching step {step}: {objective.last_method} sampling, shift {objective.shift:g}, sigma "
                f"[{low:.4f}, {high:.4f}] mean {float(sigmas.mean()):.4f} std {spread:.4f}, timesteps "
                f"[{low * objective.num_train_timesteps:.1f}, {high * objective.num_train_timesteps:.1f}]"]
    if step % settings.summary_log_interval == 0:
        return [f"flow matching step {step}: sigma [{low:.3f}, {high:.3f}] ({objective.last_method})"]
    return []


def exploded(loss: float) -> bool:
    """Upstream's performance.check_loss: a NaN, or a loss above 100."""
    return math.isnan(loss) or loss > 100
