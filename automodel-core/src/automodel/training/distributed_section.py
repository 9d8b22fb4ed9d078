"""``distributed:``: how a run is spread over processes (the device mesh's sizes, the sharding strategy, mixed
precision, activation checkpointing) and upstream's FSDP2 / DDP / pipeline / MoE settings, with the helpers that
read its upstream ``moe`` settings where they act."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from automodel.config.schema import FieldErrors, require_positive
from automodel.config.schema import field_help as _help
from automodel.model_backend import backend_setting
from automodel.training.multimodal_section import multimodal_errors
from automodel.training.parallel.offload import offload_problem

# upstream's MegatronFSDPConfig settings beyond the mesh sizes
_MEGATRON_FSDP_KEYS = ("megatron_fsdp_unit_modules", "zero_dp_strategy", "init_fsdp_with_meta_device",
                       "overlap_grad_reduce", "overlap_param_gather", "check_for_nan_in_grad",
                       "report_nan_in_param_grad", "average_in_collective", "disable_bucketing",
                       "calculate_per_token_loss", "nccl_ub", "fsdp_double_buffer", "grad_reduce_in_fp32",
                       "preserve_fp32_weights", "keep_fp8_transpose_cache")


@dataclass
class DistributedConfig:
    accepted_targets: ClassVar[dict] = {"FSDP2Manager": {"strategy": "fsdp2"}, "DDPManager": {"strategy": "ddp"},
                                        "MegatronFSDPManager": {"strategy": "megatron_fsdp"}}
    # upstream's keys that choose nothing here: (values accepted, being what happens, why any other is refused)
    upstream_refused: ClassVar[dict[str, tuple[tuple, str]]] = {
        "tp_plan": ((None,), "a tensor-parallel plan here is the model's own (base_model_tp_plan) or one a plugin "
                             "registers (automodel.training.parallel.tp_plans.TP_PLANS.register); remove it"),
        "activation_checkpointing_scope": ((None,), "activation checkpointing wraps the language model's transformer "
                                                    "blocks (every block of an LLM), not chosen by scope; remove it"),
        **{name: ((None,), "a setting of upstream's Megatron-FSDP (strategy megatron_fsdp), which needs CUDA and "
                           "Megatron Core; remove it (FSDP2 is strategy fsdp2)") for name in _MEGATRON_FSDP_KEYS},
    }
    strategy: Literal["fsdp2", "megatron_fsdp", "ddp"] | None = field(
        default=None, metadata=_help("how the model is sharded across data-parallel ranks (unset: ddp; fsdp2, "
                                     "upstream's default, where tp_size, pp_size, cp_size or ep_size > 1 needs it)"))
    dp_size: int | Literal["auto", "none"] | None = field(
        default="auto", metadata=_help("data-parallel ranks in all ('auto', 'none' or null: world size / (tp_size * "
                                       "cp_size * pp_size))"))
    dp_replicate_size: int | Literal["none"] | None = field(
        default=1, metadata=_help("HSDP: replicas of the model, each sharded over dp_size / dp_replicate_size ranks "
                                  "(fsdp2 only; null or 'none', upstream's spelling: 1)"))
    tp_size: int = field(default=1, metadata=_help(
        "tensor-parallel size: each attention / MLP projection (and the output head) sharded over this many ranks "
        "with DTensor, by the model's tp plan (strategy fsdp2, which shards over dp_size; it must divide the "
        "model's heads, key/value heads, intermediate and vocabulary sizes; LoRA adapters sharded like their "
        "projections; the LLM and VLM fine-tuning recipes)"))
    cp_size: int = field(default=1, metadata=_help(
        "context-parallel size: each sequence split over this many ranks, attention as cp_attention says (fsdp2; "
        "LLM and VLM recipes; with tp_size and sequence_parallel; with pp the LLM recipes only, all_gather attention)"))
    cp_attention: Literal["auto", "ring", "all_gather"] = field(default="auto", metadata=_help(
        "with cp_size > 1, the attention over the split sequence: ring (torch's ring attention: CUDA only, one "
        "causal attention over the whole row), all_gather (every rank's keys and values gathered, SDPA with an exact "
        "mask: any device; padding, packed rows and sliding windows kept), auto: ring where it runs the model's "
        "attention (CUDA, sdpa, no packing, no sliding windows, no pp), else all_gather"))
    pp_size: int = field(default=1, metadata=_help(
        "pipeline-parallel size: the decoder layers split into stages, one or more per rank (strategy fsdp2, "
        "which shards each stage over dp_size; the LLM recipes and the VLM fine-tuning one, whose first stage holds "
        "the vision tower; see pipeline for the schedules; LoRA adapts each stage)"))
    ep_size: int | None = field(default=None, metadata=_help(
        "expert-parallel size: each group of ep_size data-parallel ranks splits the experts of every MoE layer of a "
        "Hugging Face MoE model (fused gate_up_proj / down_proj experts); it must divide the data-parallel ranks "
        "(of each pipeline stage with pp_size) and the number of experts (strategy fsdp2, no tp / cp; LoRA on the "
        "experts too; null or 1: off)"))
    sequence_parallel: bool = field(default=False, metadata=_help(
        "with tp_size > 1: norms and dropout inside the decoder layers run on each rank's part of the sequence "
        "(the sequence length must divide by tp_size)"))
    activation_checkpointing: bool | Literal["full", "selective"] = field(
        default=False, metadata=_help("recompute each transformer block's activations in backward instead of "
                                      "keeping them (less memory, about a third more compute); true or full: all "
                                      "of them; selective (upstream's, TorchTitan's): keep the outputs of attention "
                                      "and of every other matmul, recompute the rest"))
    mp_policy: dict | None = field(
        default=None, metadata=_help("mixed precision {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs} "
                                     "(dtypes bf16 | fp16 | fp32; also `_target_: torch.distributed.fsdp."
                                     "MixedPrecisionPolicy`); null: fp32 on CPU, bf16 on GPUs that support it"))
    offload_policy: dict | None = field(default=None, metadata=_help(
        "FSDP2's CPU offload, upstream's {_target_: torch.distributed.fsdp.CPUOffloadPolicy, pin_memory: true}: each "
        "rank's parameter shards, gradients and optimizer state stay in host memory, the optimizer steps on the CPU "
        "(fsdp2 with more than one process, also with tp_size; not with cp / pp / ep; pin_memory: pinned host copies "
        "on CUDA)"))
    autocast_dtype: str | None = field(
        default=None, metadata=_help("also run the forward under torch.autocast in this dtype (bf16 | fp16), as "
                                     "upstream does with mp_policy.output_dtype fp32"))
    pipeline: dict | None = field(default=None, metadata=_help(
        "upstream's pipeline-parallel settings: pp_schedule (gpipe, 1f1b; interleaved1f1b, looped_bfs: several "
        "stages per rank), pp_microbatch_size, layers_per_stage, round_virtual_stages_to_pp_multiple (up, down), "
        "pp_seq_len (every training batch padded to it, the stages built with static shapes: no shape-finding pass) "
        "with dtype (the activations' dtype there; default: the run's; dtype without pp_seq_len: static shapes of "
        "each training batch's own length, upstream's update_seq_len); "
        "with pp_size 1 they govern nothing, upstream's rule too, and the run says so"))
    moe: dict | None = field(default=None, metadata=_help(
        "upstream's expert-parallel settings; with ep_size > 1: reshard_after_forward and mp_policy act as "
        "distributed.reshard_after_forward / mp_policy (a different value there is refused), lm_head_precision "
        "float32 keeps the output head in fp32 (its own FSDP2 unit), ignore_router_for_ac true (with "
        "activation_checkpointing) saves the routing top-k instead of recomputing it, wrap_outer_model false makes "
        "the inner model the FSDP2 root (true: the whole model, what FSDP2 here does anyway); with ep_size 1 (or "
        "null) they govern nothing, upstream's rule too, and the run says so"))
    defer_fsdp_grad_sync: bool = field(default=True, metadata=_help(
        "under FSDP2 with gradient accumulation, reduce-scatter the gradients once, after a step's last "
        "micro-batch (false: after every micro-batch; less memory, more communication)"))
    reshard_after_forward: bool | None = field(default=None, metadata=_help(
        "FSDP2 frees each block's gathered parameters after its forward: null, every block but the last (backward "
        "needs it first); true: every block; false: none (more memory, no second gather in backward)"))
    enable_fsdp2_prefetch: bool = field(default=False, metadata=_help(
        "FSDP2 gathers the next blocks' parameters ahead of use (the depths below) instead of its implicit "
        "one-block prefetch (fsdp2 with more than one process)"))
    fsdp2_forward_prefetch_depth: int = field(default=1, metadata=_help(
        "blocks gathered ahead in forward (with enable_fsdp2_prefetch)"))
    fsdp2_backward_prefetch_depth: int = field(default=2, metadata=_help(
        "blocks gathered ahead in backward (with enable_fsdp2_prefetch)"))
    enable_compile: bool = field(default=False, metadata=_help(
        "torch.compile each transformer block in place, after activation checkpointing and sharding (upstream's "
        "per-layer compile; names unchanged), with compile:'s backend, mode, fullgraph and dynamic; not together "
        "with compile.enabled, which compiles the whole model"))
    enable_async_tensor_parallel: bool = field(default=False, metadata=_help(
        "refused when true: async tensor parallelism needs tp_size > 1 and CUDA, and is not done here"))
    patch_is_packed_sequence: bool = field(default=False, metadata=_help(
        "refused when true: upstream's patch removes a CUDA synchronisation per attention layer (for CUDA graphs "
        "and torch.compile on GPUs); it would also mis-read packed sequences"))
    multimodal: dict | None = field(default=None, metadata=_help(
        "upstream's FSDP2 policy for fully frozen vision / audio towers and projectors (vision-language recipes): "
        "frozen_sharding root (default: their parameters in the outer unit), per_layer (each of their blocks a "
        "unit; every rank must run them alike on each micro-batch) or replicate (left out of FSDP2: a full copy "
        "on every rank); a module with a trainable parameter has its blocks sharded like the language model's "
        "whatever the setting; vision.frame_sharding {enabled, min_tokens, min_frames, min_local_patch_rows, "
        "cost_alpha, mesh_dims: [cp]}: with cp_size > 1, each cp rank runs the vision encoder on its share of the "
        "images / frames (Qwen-VL towers), the features gathered"))
    # torch DDP's own options (upstream's DDPConfig), passed to DistributedDataParallel (strategy ddp)
    find_unused_parameters: bool = field(default=False, metadata=_help(
        "DDP: look for parameters a forward did not use, so their gradients count as ready (a model with branches "
        "a batch may skip; costs a graph traversal per step)"))
    static_graph: bool = field(default=False, metadata=_help(
        "DDP: the set of used parameters is the same every step, so DDP may fix its plan after the first one"))
    bucket_cap_mb: float | None = field(default=None, metadata=_help(
        "DDP: the size in MiB of each bucket of gradients all-reduced together (null: torch's default, 25)"))
    gradient_as_bucket_view: bool = field(default=False, metadata=_help(
        "DDP: the gradients are views into DDP's buckets instead of copies (less memory)"))
    broadcast_buffers: bool = field(default=True, metadata=_help(
        "DDP: rank 0's buffers (a batch norm's running statistics, say) are sent to the others at each forward "
        "(torch's default; upstream's is false)"))

    def ddp_options(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` these settings give (bucket_cap_mb when set)."""
        options = {name: getattr(self, name) for name in DDP_OPTIONS if name != "bucket_cap_mb"}
        if self.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = self.bucket_cap_mb
        return options

    def ddp_options_given(self) -> dict[str, Any]:
        """The DDP options set to something other than torch's default, by name."""
        return {name: getattr(self, name) for name, default in DDP_OPTIONS.items() if getattr(self, name) != default}

    def __post_init__(self) -> None:
        if self.dp_replicate_size in (None, "none"):
            self.dp_replicate_size = 1
        if self.strategy is None:  # model parallelism composes with FSDP2 only (upstream's default strategy)
            sizes = (self.tp_size, self.pp_size, self.cp_size, self.ep_size or 1)
            self.strategy = "fsdp2" if any(isinstance(n, int) and n > 1 for n in sizes) else "ddp"
        require_positive(self, "tp_size", "cp_size", "pp_size", "ep_size", "dp_replicate_size",
                         "fsdp2_forward_prefetch_depth", "fsdp2_backward_prefetch_depth",
                         *(("dp_size",) if isinstance(self.dp_size, int) else ()))
        errors = {}
        if self.cp_attention != "auto" and self.cp_size == 1:
            errors["cp_attention"] = (f"{self.cp_attention} with cp_size 1: no sequence is split, so no context-"
                                      "parallel attention runs; set cp_size > 1 or remove the key")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            errors["bucket_cap_mb"] = f"must be > 0 (MiB), found {self.bucket_cap_mb}"
        if self.enable_async_tensor_parallel:
            errors["enable_async_tensor_parallel"] = (
                "true overlaps tensor parallelism's reduce-scatter with compute, which needs tp_size > 1 and CUDA "
                "(symmetric memory); this build's tensor parallelism does not overlap them: set it false (tp_size "
                "acts without it)")
        if self.patch_is_packed_sequence:
            errors["patch_is_packed_sequence"] = (
                "true patches transformers to skip a CUDA synchronisation per attention layer (a speed-up for CUDA "
                "graphs / torch.compile on GPUs), which this build does not do; set it false (training is the "
                "same without it)")
        if self.multimodal is not None:
            errors.update(multimodal_errors(self.multimodal))
        if (problem := offload_problem(self.offload_policy)) is not None:
            errors["offload_policy"] = problem
        for name in ("pipeline", "moe"):
            value = getattr(self, name)
            unknown = sorted(set(value) - _UPSTREAM_KEYS[name]) if isinstance(value, dict) else []
            if unknown:
                errors[name] = (f"{', '.join(unknown)}: not a key of upstream's {name} settings (they are: "
                                f"{', '.join(sorted(_UPSTREAM_KEYS[name]))})")
        if (self.ep_size or 1) > 1 and isinstance(self.moe, dict):
            errors.update(self._take_moe_settings())
        if not self.enable_fsdp2_prefetch:
            for name, default in (("fsdp2_forward_prefetch_depth", 1), ("fsdp2_backward_prefetch_depth", 2)):
                if getattr(self, name) != default:
                    errors[name] = f"{getattr(self, name)} acts only with enable_fsdp2_prefetch: true; set that too"
        if errors:
            raise FieldErrors(errors)

    def _take_moe_settings(self) -> dict[str, str]:
        """With ``ep_size > 1``: upstream's ``moe.reshard_after_forward`` / ``moe.mp_policy`` become this section's
        keys of the same name (which FSDP2 here applies to the whole model, experts aside); the other keys are
        checked here and read where they act (:func:`moe_head_fp32`, :func:`moe_inner_root`,
        :func:`moe_saves_routing`)."""
        errors = {}
        for name in ("ignore_router_for_ac", "wrap_outer_model", "reshard_after_forward"):
            if not isinstance(self.moe.get(name, True), bool):
                errors[f"moe.{name}"] = f"{self.moe[name]!r}: must be true or false"
        for name in ("reshard_after_forward", "mp_policy"):
            if name not in self.moe or f"moe.{name}" in errors:
                continue
            value, own = self.moe[name], getattr(self, name)
            if own is not None and own != value:
                errors[f"moe.{name}"] = (f"{value} differs from distributed.{name} ({own}); FSDP2 here has one "
                                         f"{name} for the whole model: give one value, in either place")
            else:
                setattr(self, name, value)
        head = self.moe.get("lm_head_precision")
        if head is not None and str(head).removeprefix("torch.") not in _FP32_NAMES:
            errors["moe.lm_head_precision"] = (
                f"{head}: only float32 is taken (the output head in fp32, its own FSDP2 unit); in any other dtype "
                "the head follows distributed.mp_policy like the rest of the model: remove the key")
        return errors


_FP32_NAMES = ("float32", "fp32")
# DistributedDataParallel's options that distributed.* passes on, with torch's defaults
DDP_OPTIONS = {"find_unused_parameters": False, "static_graph": False, "bucket_cap_mb": None,
               "gradient_as_bucket_view": False, "broadcast_buffers": True}


def moe_head_fp32(settings: DistributedConfig | None) -> bool:
    """``distributed.moe.lm_head_precision: float32`` under expert parallelism: the output head runs in fp32."""
    return (settings is not None and (settings.ep_size or 1) > 1 and isinstance(settings.moe, dict)
            and settings.moe.get("lm_head_precision") is not None)


def moe_inner_root(settings: DistributedConfig | None) -> bool:
    """``distributed.moe.wrap_outer_model: false`` under expert parallelism: the inner model is the FSDP2 root, the
    output head its own unit, the outer causal-LM wrapper unsharded (true: the whole model is the root, as
    without the key)."""
    return (settings is not None and (settings.ep_size or 1) > 1 and isinstance(settings.moe, dict)
            and settings.moe.get("wrap_outer_model") is False)


def moe_saves_routing(settings: DistributedConfig | None) -> bool:
    """``distributed.moe.ignore_router_for_ac: true`` under expert parallelism and activation checkpointing: the
    routing top-k of the first forward is saved, not recomputed in backward (false: recomputed, as without it)."""
    return (settings is not None and (settings.ep_size or 1) > 1 and settings.activation_checkpointing
            and isinstance(settings.moe, dict) and settings.moe.get("ignore_router_for_ac") is True)


# The keys of upstream's PipelineConfig and MoEParallelizerConfig (distributed.pipeline / distributed.moe)
_UPSTREAM_KEYS = {
    "pipeline": {"pp_schedule", "pp_schedule_csv", "pp_microbatch_size", "pp_batch_size", "layers_per_stage",
                 "round_virtual_stages_to_pp_multiple", "module_fqns_per_model_part", "patch_inner_model",
                 "patch_causal_lm_model", "patch_stage_backward_maybe_with_nosync", "dtype",
                 "scale_grads_in_schedule", "loss_fn", "pp_seq_len"},
    "moe": {"ignore_router_for_ac", "reshard_after_forward", "lm_head_precision", "wrap_outer_model", "mp_policy"},
}


def grad_sync_deferred(settings: DistributedConfig, model_section: Any) -> bool:
    """Whether FSDP2 reduces a step's gradients after its last micro-batch only: ``defer_fsdp_grad_sync`` (default
    true), or ``model.backend.enable_fsdp_optimizations: true``, which defers whatever the former says (as upstream's
    models with it do)."""
    return settings.defer_fsdp_grad_sync or bool(backend_setting(model_section, "enable_fsdp_optimizations"))
