"""The run's parallel layout and precision from ``distributed.*`` and the world size: one place that validation,
the ``--dry-run`` plan and ``TrainRecipe.setup`` read, so the three agree.

The world size is the launch's: ``--nproc-per-node N --nnodes M`` when the CLI validates a run it is about to start,
else this process's ``WORLD_SIZE`` (1 outside torchrun) — see ``dist.expected_world_size``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from automodel.config.registry import HF_CONFIG_PATH
from automodel.config.targets import TargetResolver
from automodel.config.trust import UserTrust
from automodel.errors import ConfigIssue
from automodel.model_files import HUB_ARGUMENTS
from automodel.model_kwargs import SDPA_METHOD_PARALLEL_REFUSAL
from automodel.training.dist import expected_world_size, world_size_source
from automodel.training.distributed_section import moe_head_fp32, moe_inner_root
from automodel.training.parallel.expert_parallel import config_expert_count, expert_count_issues, experts_issues
from automodel.training.parallel.mesh import MeshLayout, describe_mesh, mesh_issues, plan_mesh
from automodel.training.parallel.pipeline_parallel import (
    PipelineSettings,
    describe_stages,
    pp_issues,
    section_issues,
    static_issues,
)
from automodel.training.parallel.pipeline_static import static_shape_issues, static_shapes_unsupported
from automodel.training.parallel.precision import Precision, parse_dtype_name, precision_issues, resolve_precision
from automodel.training.parallel.tensor_parallel import describe_plan, tp_issues
from automodel.training.parallel.tp_plans import HEAD_STYLES, config_plan, expand_plan, model_plan

if TYPE_CHECKING:
    from automodel.config import Config

# model-section keys that name a Hugging Face model (its config, or a checkpoint holding one)
HF_MODEL_KEYS = ("config", "pretrained_model_name_or_path", "name_or_path")
# model-section keys that are not the architecture's (what from_config / from_pretrained take besides config keys)
_NOT_CONFIG_KEYS = {"_target_", "config", "dtype", "torch_dtype", "seed", "pretrained_model_name_or_path",
                    "name_or_path", "attn_implementation", "trust_remote_code", *HUB_ARGUMENTS}


def shards_with_fsdp2(cfg: Config, implementation: str | None, world: int) -> bool:
    """Whether the sharding slot runs the core's FSDP2 (``implementation``: the recipe's choice for the slot)."""
    strategy = cfg.distributed.strategy if cfg.distributed is not None else None
    return world > 1 and (implementation or strategy) == "fsdp2"


def mesh_layout(cfg: Config, world: int) -> tuple[MeshLayout, list[ConfigIssue]]:
    """The mesh for ``world`` ranks and its problems (with problems: plain data parallelism over every rank)."""
    settings = cfg.distributed
    if settings is None:
        return MeshLayout(world, dp_shard=world), []
    issues = mesh_issues(world, settings.dp_size, settings.dp_replicate_size, settings.tp_size, settings.cp_size,
                         settings.pp_size)
    return (MeshLayout(world, dp_shard=world) if issues else parallel_layout(cfg, world)), issues


def parallel_layout(cfg: Config, world: int) -> MeshLayout:
    """The validated mesh for ``world`` ranks (a ``ConfigError`` naming every wrong key otherwise)."""
    settings = cfg.distributed
    if settings is None:
        return MeshLayout(world, dp_shard=world)
    return plan_mesh(world, settings.dp_size, settings.dp_replicate_size, settings.tp_size, settings.cp_size,
                     settings.pp_size)


def validation_device() -> torch.device:
    """The device a run would train on here (what the default precision depends on)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_precision(cfg: Config, device: torch.device, fsdp2: bool) -> tuple[Precision, list[ConfigIssue]]:
    """The precision ``distributed.mp_policy`` / ``autocast_dtype`` give on ``device``, and their problems."""
    settings = cfg.distributed
    if settings is None:
        return resolve_precision(None, device, fsdp2), []
    issues = precision_issues(settings.mp_policy, device, fsdp2, autocast_dtype=settings.autocast_dtype)
    if issues:
        return resolve_precision(None, device, fsdp2), issues
    return resolve_precision(settings.mp_policy, device, fsdp2, autocast_dtype=settings.autocast_dtype), []


def parallel_issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """What ``distributed.*`` asks that this build or this world size cannot do, each under its key."""
    settings = cfg.distributed
    if settings is None:
        return []
    world = expected_world_size()
    issues = pipeline_parallel_issues(cfg, implementation) if settings.pp_size > 1 else []
    if settings.tp_size > 1:
        issues += tensor_parallel_issues(cfg, implementation)
    elif settings.sequence_parallel:
        issues.append(ConfigIssue("distributed.sequence_parallel", "true shards the sequence over the "
                                  "tensor-parallel ranks, so it needs tensor parallelism (distributed.tp_size > 1); "
                                  "set it to false"))
    if (settings.ep_size or 1) > 1:
        issues += expert_parallel_issues(cfg, implementation, world)
    fsdp2 = shards_with_fsdp2(cfg, implementation, world)
    if settings.dp_replicate_size > 1 and not fsdp2:
        issues.append(ConfigIssue("distributed.dp_replicate_size", f"{settings.dp_replicate_size}: HSDP replicates "
                                  "FSDP2's shards, so it needs distributed.strategy: fsdp2 and more than one "
                                  f"process (this run: {world_size_source()}); use 1"))
    if settings.enable_fsdp2_prefetch and not fsdp2:
        issues.append(ConfigIssue("distributed.enable_fsdp2_prefetch", "true orders FSDP2's parameter gathers, so "
                                  "it needs distributed.strategy: fsdp2 and more than one process (this run: "
                                  f"{world_size_source()}); set it false"))
    if cfg.model is not None and cfg.model.get("sdpa_method") and (settings.pp_size > 1 or settings.cp_size > 1):
        issues.append(ConfigIssue("model.sdpa_method", SDPA_METHOD_PARALLEL_REFUSAL))
    strategy = implementation or settings.strategy
    if strategy != "ddp":
        for name, value in settings.ddp_options_given().items():
            issues.append(ConfigIssue(f"distributed.{name}", f"{str(value).lower()} is an option of torch's "
                                      f"DistributedDataParallel (strategy ddp); strategy {strategy} does not run "
                                      "DDP: remove it or use distributed.strategy: ddp"))
    issues += mesh_layout(cfg, world)[1]
    issues += run_precision(cfg, validation_device(), fsdp2)[1]
    return issues


def tensor_parallel_issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """``tp_size > 1``: FSDP2 as the data-parallel strategy, no LoRA, and a model whose sizes ``tp_size`` divides
    (checked again on the built model where its config cannot be read here)."""
    settings = cfg.distributed
    issues = []
    if (implementation or settings.strategy) != "fsdp2":
        issues.append(ConfigIssue("distributed.strategy", f"{implementation or settings.strategy}: tensor "
                                  f"parallelism (tp_size {settings.tp_size}) composes with FSDP2 on the data-parallel "
                                  "dimension only; set distributed.strategy: fsdp2"))
    issues += _lora_tp_issues(cfg)
    hf_config = model_hf_config(cfg)
    if hf_config is not None:
        issues += tp_issues(hf_config, settings.tp_size, settings.sequence_parallel)
    elif cfg.model is None or not any(cfg.model.get(key) for key in HF_MODEL_KEYS):
        issues.append(ConfigIssue("distributed.tp_size", f"{settings.tp_size}: tensor parallelism follows the plan of "
                                  "a Hugging Face model, so it needs a Hugging Face model section (model.config or "
                                  "model.pretrained_model_name_or_path); this model has neither, use tp_size: 1"))
    return issues


def _lora_tp_issues(cfg: Config) -> list[ConfigIssue]:
    """LoRA under tensor parallelism: each adapter matrix is sharded like its base projection or replicated over the
    ``tp`` ranks, so what would make the ranks' replicated copies differ, or needs a whole weight, is refused."""
    peft = cfg.get("peft")
    if peft is None:
        return []
    tp = cfg.distributed.tp_size
    get = peft.get if hasattr(peft, "get") else (lambda key, default=None: getattr(peft, key, default))
    issues = []
    dropout = get("dropout", None) or get("lora_dropout", None) or 0.0
    if dropout:
        issues.append(ConfigIssue("peft.dropout", f"{dropout} with tp_size {tp}: each tensor-parallel rank would draw "
                                  "its own dropout mask for one replicated adapter input; set it to 0.0"))
    for key in ("use_dora", "use_memory_efficient_lora"):
        if get(key, False):
            issues.append(ConfigIssue(f"peft.{key}", f"true with tp_size {tp}: it computes on whole adapter and base "
                                      "weights, which tensor parallelism shards; set it false or tp_size: 1"))
    return issues


def pipeline_settings(cfg: Config) -> PipelineSettings:
    """``distributed.pipeline`` as :class:`PipelineSettings` (upstream's defaults where it is absent); without
    ``pp_seq_len``, upstream's: the packed rows' length (``packed_sequence.packed_sequence_size``), else the data
    set's ``seq_len``, else none (batches find their shape), also where ``static_shapes_unsupported`` says why."""
    distributed = cfg.distributed
    settings = PipelineSettings.from_section(distributed.pipeline if distributed is not None else None)
    if settings.pp_seq_len is not None or distributed is None:
        return settings
    packed = getattr(cfg.get("packed_sequence"), "packed_sequence_size", 0)
    dataset = cfg.get("dataset")
    length = packed if _positive(packed) else dataset.get("seq_len") if hasattr(dataset, "get") else None
    if not _positive(length) or static_shapes_unsupported(distributed.tp_size, distributed.cp_size,
                                                          distributed.sequence_parallel, length):
        return settings
    return dataclasses.replace(settings, pp_seq_len=length)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def rows_per_batch(cfg: Config) -> int:
    """The rows of one micro-batch of a step on one data-parallel rank (what the pipeline splits further)."""
    loader, steps = cfg.dataloader, cfg.step_scheduler
    return (loader.get("batch_size") if loader is not None else None) or \
        (steps.local_batch_size if steps is not None else None) or 1


def pipeline_parallel_issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """``pp_size > 1``: FSDP2 as the data-parallel strategy, upstream's other pipeline keys at the values that run
    here, and a model whose layers and micro-batches the layout fits, one stage per rank or several (interleaved
    schedules; checked on the model's Hugging Face config)."""
    settings = cfg.distributed
    pp = settings.pp_size
    issues = section_issues(settings.pipeline)
    if (implementation or settings.strategy) != "fsdp2":
        issues.append(ConfigIssue("distributed.strategy", f"{implementation or settings.strategy}: pipeline "
                                  f"parallelism (pp_size {pp}) composes with FSDP2 on the data-parallel dimension "
                                  "only; set distributed.strategy: fsdp2"))
    if cfg.compile is not None and cfg.compile.enabled:
        issues.append(ConfigIssue("compile.enabled", f"true: the pipeline schedule (pp_size {pp}) runs the stage "
                                  "module itself, not a torch.compile wrapper; set it false with pipeline parallelism"))
    precision, _ = run_precision(cfg, validation_device(), fsdp2=True)
    if precision.compute_dtype(storage_dtype_name(cfg) or torch.float32, True) == torch.float16:
        issues.append(ConfigIssue("distributed.mp_policy.param_dtype", f"fp16 needs loss scaling, which is not wired "
                                  f"into the pipeline schedule (pp_size {pp}); use bf16 or fp32"))
    pipeline = pipeline_settings(cfg)
    found = static_issues(pipeline)
    if not found and (pipeline.pp_seq_len is not None or pipeline.dtype is not None):
        unsupported = static_shapes_unsupported(settings.tp_size, settings.cp_size, settings.sequence_parallel,
                                                pipeline.pp_seq_len)
        found = static_shape_issues(pipeline, precision, storage_dtype_name(cfg), unsupported)
    issues += found
    hf_config = model_hf_config(cfg)
    if hf_config is not None:
        issues += pp_issues(hf_config, pp, pipeline, rows_per_batch(cfg))
    elif cfg.model is None or not any(cfg.model.get(key) for key in HF_MODEL_KEYS):
        issues.append(ConfigIssue("distributed.pp_size", f"{pp}: pipeline stages follow the pipeline plan of a "
                                  "Hugging Face model, so it needs a Hugging Face model section (model.config or "
                                  "model.pretrained_model_name_or_path); this model has neither, use pp_size: 1"))
    return issues


def pipeline_lines(cfg: Config) -> list[str]:
    """The ``--dry-run`` lines of the pipeline stages per rank, when ``pp_size > 1``."""
    settings = cfg.distributed
    if settings is None or settings.pp_size == 1:
        return []
    hf_config = model_hf_config(cfg)
    pipeline = pipeline_settings(cfg)
    if hf_config is None or pp_issues(hf_config, settings.pp_size, pipeline, rows_per_batch(cfg)):
        return [f"pipeline parallel over pp {settings.pp_size}: the stages are the built model's (its config cannot "
                "be read or does not fit the layout)"]
    return describe_stages(hf_config, settings.pp_size, pipeline, rows_per_batch(cfg))


def expert_parallel_issues(cfg: Config, implementation: str | None, world: int) -> list[ConfigIssue]:
    """``ep_size > 1``: FSDP2 over the data- and context-parallel ranks (no tp; with pp over each stage's),
    ``ep_size`` dividing those ranks and the model's experts, a MoE model whose experts module is handled here
    (checked again on the built model where its config cannot be read here)."""
    settings = cfg.distributed
    ep = settings.ep_size
    key = "distributed.ep_size"
    issues = []
    if (implementation or settings.strategy) != "fsdp2":
        issues.append(ConfigIssue("distributed.strategy", f"{implementation or settings.strategy}: expert "
                                  f"parallelism (ep_size {ep}) composes with FSDP2 only; set distributed.strategy: "
                                  "fsdp2"))
    ranks = world // settings.pp_size  # a stage's data-parallel x context-parallel ranks (tp_size 1)
    if settings.tp_size > 1:
        issues.append(ConfigIssue(key, f"{ep}: expert parallelism runs over the data- and context-parallel ranks and "
                                  f"is not combined with tensor parallelism here (tp_size {settings.tp_size}); set "
                                  "tp_size: 1 or ep_size: 1"))
    elif ranks and (ep > ranks or ranks % ep):  # no rank at all: the dp_size check says why
        stages = f" = world size / pp_size {settings.pp_size}" if settings.pp_size > 1 else ""
        issues.append(ConfigIssue(key, f"{ep} does not divide the data-parallel x context-parallel ranks "
                                  f"({ranks}{stages}, {world_size_source()}): each group of ep_size ranks splits the "
                                  f"experts; use an ep_size that divides {ranks}"))
    hf_config = model_hf_config(cfg)
    if hf_config is not None:
        issues += _model_expert_issues(hf_config, ep)
        if getattr(hf_config.get_text_config(), "tie_word_embeddings", False):
            if moe_head_fp32(settings):
                issues.append(ConfigIssue("distributed.moe.lm_head_precision", "float32: the model ties its output "
                                          "head to the input embeddings (tie_word_embeddings), so the head cannot "
                                          "run in its own precision; remove the key"))
            if moe_inner_root(settings):
                issues.append(ConfigIssue("distributed.moe.wrap_outer_model", "false: the model ties its output "
                                          "head to the input embeddings (tie_word_embeddings), which must then stay "
                                          "in one FSDP2 root, the whole model's; set it true"))
    elif cfg.model is None or not any(cfg.model.get(k) for k in HF_MODEL_KEYS):
        issues.append(ConfigIssue(key, f"{ep}: expert parallelism splits the experts of a Hugging Face MoE model, so "
                                  "it needs a Hugging Face model section (model.config or model."
                                  "pretrained_model_name_or_path); use ep_size: 1"))
    return issues


def _model_expert_issues(hf_config: Any, ep_size: int) -> list[ConfigIssue]:
    """The experts of the causal LM ``hf_config`` describes, built on the meta device (no memory); where it
    cannot be built here, its declared number of experts."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # not a causal LM transformers builds: the config's count, the built model is checked later
        experts = config_expert_count(hf_config)
        return expert_count_issues(experts, ep_size) if experts is not None else []
    return experts_issues(model, ep_size)


def model_hf_config(cfg: Config, section: str = "model") -> Any:
    """The Hugging Face config of the model section (``section``: another, a teacher's say) where it can be read
    without building the model: ``model.config`` (a config.json, a directory, a mapping with ``model_type``, a node
    naming a configuration class or AutoConfig.from_pretrained; the section's other keys override it), else a local
    ``pretrained_model_name_or_path`` / ``name_or_path`` or one in the Hugging Face cache. None when it cannot be
    read here (the built model is checked instead)."""
    model = cfg.get(section)
    if model is None:
        return None
    try:
        from transformers import AutoConfig

        data = model.to_dict()
        source = data.get("config")
        overrides = {k: v for k, v in data.items() if k not in _NOT_CONFIG_KEYS and not isinstance(v, (dict, list))}
        # a transformers configuration class, by its path or an alias of it (upstream's own config class paths)
        target = model.resolver.expand(str(source.get("_target_"))) if isinstance(source, dict) else ""
        if HF_CONFIG_PATH.fullmatch(target) and not target.startswith("transformers.AutoConfig."):
            fields = {k: v for k, v in source.items() if k != "_target_"}  # AutoConfig's node: its path, below
            return TargetResolver(trust=UserTrust()).resolve(target)(**{**fields, **overrides})
        if isinstance(source, dict) and "_target_" in source:  # upstream's AutoConfig.from_pretrained node
            node = {k: v for k, v in source.items() if k not in ("_target_", "trust_remote_code")}
            source, overrides = node.pop("pretrained_model_name_or_path", None), {**node, **overrides}
        if source is None:
            name = data.get("pretrained_model_name_or_path") or data.get("name_or_path")
            return AutoConfig.from_pretrained(str(name), local_files_only=True) if name else None
        if isinstance(source, dict):
            fields = dict(source)
            return AutoConfig.for_model(fields.pop("model_type"), **{**fields, **overrides})
        path = Path(str(source))
        if path.is_file():
            fields = json.loads(path.read_text(encoding="utf-8"))
            return AutoConfig.for_model(fields.pop("model_type"), **{**fields, **overrides})
        return AutoConfig.from_pretrained(str(source), local_files_only=True, **overrides)
    except Exception:  # unreadable here (a hub name not cached, a damaged file): the model's build says why
        return None


def tensor_parallel_lines(cfg: Config) -> list[str]:
    """The ``--dry-run`` lines of the tensor-parallel plan per module, when ``tp_size > 1``: that of the causal LM
    (or image-text-to-text model) the model's config describes, built on the meta device (no memory), else the plan
    its config declares."""
    settings = cfg.distributed
    if settings is None or settings.tp_size == 1:
        return []
    hf_config = model_hf_config(cfg)
    if hf_config is None:
        return [f"tensor parallel over tp {settings.tp_size}: the plan is the built model's (its config cannot be "
                "read before the build)"]
    plan = config_plan(hf_config) or {}  # not a model transformers knows, or no plan: the config's own, as patterns
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            with torch.device("meta"):
                model = auto.from_config(hf_config)
            plan = expand_plan(model_plan(model), model, require_all=False)
            break
        except Exception:  # not an architecture of this auto class, or no plan
            continue
    return describe_plan(plan, settings.tp_size, settings.sequence_parallel,
                         vocab_parallel=any(style in HEAD_STYLES for style in plan.values()))


def storage_dtype_name(cfg: Config) -> torch.dtype | None:
    """The dtype the model section asks for (``dtype`` / ``torch_dtype``), None when it names none."""
    model = cfg.model
    for key in ("dtype", "torch_dtype"):
        value = model.get(key) if model is not None else None
        if value is not None and value != "auto":
            return parse_dtype_name(value)
    return None


def plan_lines(cfg: Config, implementation: str | None) -> list[str]:
    """The ``--dry-run`` lines: the world size and where it comes from, the mesh and each rank's place, precision."""
    world = expected_world_size()
    layout, _ = mesh_layout(cfg, world)
    fsdp2 = shards_with_fsdp2(cfg, implementation, world)
    precision, _ = run_precision(cfg, validation_device(), fsdp2)
    stored = storage_dtype_name(cfg)
    line = precision.describe(stored or torch.float32, fsdp2)
    if stored is None:
        line += " (storage: the model's own dtype, fp32 assumed here)"
    return [f"world size: {world} ({world_size_source()})", *describe_mesh(layout), *pipeline_lines(cfg),
            *tensor_parallel_lines(cfg), *expert_parallel_lines(cfg, layout), line]


def expert_parallel_lines(cfg: Config, layout: MeshLayout) -> list[str]:
    """The ``--dry-run`` line of expert parallelism, when ``ep_size > 1``: the groups and each rank's experts."""
    settings = cfg.distributed
    ep = settings.ep_size if settings is not None else None
    if ep is None or ep == 1 or layout.world_size % ep:
        return []
    hf_config = model_hf_config(cfg)
    experts = config_expert_count(hf_config) if hf_config is not None else None
    share = f"{experts // ep} of {experts} experts" if experts is not None and experts % ep == 0 else \
        f"1/{ep} of the experts"
    return [f"expert parallel over ep {ep}: {layout.world_size // ep} group(s) of {ep} consecutive data-parallel "
            f"ranks, each rank holds {share} of every MoE layer (FSDP2 shards the rest over dp {layout.dp})"]
