"""The engine's config sections as dataclasses: keys, types, defaults and help (validated before building)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from automodel.config.schema import FieldErrors, require_positive
from automodel.config.schema import field_help as _help
from automodel.errors import ConfigIssue

# What a slurm #SBATCH value may hold: names, paths, times and sbatch's %-patterns; no spaces, quotes or control
# characters (sbatch splits the line on spaces; a newline ends the directive and starts a shell line).
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9._:@%/+,=~-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")




@dataclass
class StepSchedulerConfig:
    # upstream's StepScheduler arguments that choose nothing here: (values accepted, being what happens, why any
    # other is refused)
    upstream_refused: ClassVar[dict[str, tuple[tuple, str]]] = {
        "start_step": ((0, None), "a run starts at step 0, or where restore_from resumes; remove it"),
        "start_epoch": ((0, None), "a run starts at epoch 0, or where restore_from resumes; remove it"),
        "dp_size": ((None,), "the data-parallel size is distributed's (dp_size, or what the world size leaves); "
                             "remove it"),
        "preemption_signal": (("SIGTERM", "sigterm", 15, ["SIGTERM"], [15]), "a run stops gracefully (finishing the "
                              "step, checkpointing) on SIGTERM and on SIGINT, always: other signals are not caught, "
                              "and it cannot be turned off; remove it or give SIGTERM"),
    }
    max_steps: int | None = field(default=None, metadata=_help("optimizer steps to run (None: num_epochs decides)"))
    num_epochs: int | None = field(default=None, metadata=_help(
        "passes over the training data; unset: as many as max_steps needs (one pass without max_steps); with both "
        "set, the first limit reached ends the run"))
    grad_accumulation_steps: int | None = field(
        default=None, metadata=_help("micro-batches per optimizer step (derived from global_batch_size if unset)"))
    global_batch_size: int | None = field(
        default=None, metadata=_help("samples per optimizer step = batch_size * dp_size * grad_accumulation_steps"))
    local_batch_size: int | None = field(
        default=None, metadata=_help("samples per micro-batch on one rank (same as dataloader.batch_size)"))
    val_check_interval: int | None = field(
        default=None, metadata=_help("validate every N steps (and never if unset)", ("val_every_steps",)))
    val_at_start: bool = field(default=False, metadata=_help(
        "also validate the untouched model before the first step (recorded as step 0; not on a resume)"))
    checkpoint_interval: int | None = field(
        default=None, metadata=_help("checkpoint every N steps (and always after the last step)",
                                     ("ckpt_every_steps",)))
    save_checkpoint_every_epoch: bool = field(default=False, metadata=_help(
        "also checkpoint after each epoch's last step (upstream's default is true)"))
    log_interval: int = field(default=10, metadata=_help("write a MetricsSample to training.jsonl every N steps"))
    log_remote_every_steps: int | None = field(default=None, metadata=_help(
        "send a MetricsSample to the metric backends (logging / wandb / mlflow) every N steps (unset: with "
        "training.jsonl)"))
    loss_average_window_steps: int | None = field(default=None, metadata=_help(
        "add loss_avg_window, the mean loss of the last N steps, to every MetricsSample"))
    gc_every_steps: int | None = field(default=None, metadata=_help(
        "run Python's garbage collector every N steps instead of automatically (off for the run)"))

    def __post_init__(self) -> None:
        require_positive(self, "max_steps", "num_epochs", "grad_accumulation_steps", "global_batch_size",
                         "local_batch_size", "val_check_interval", "checkpoint_interval", "log_interval",
                         "log_remote_every_steps", "loss_average_window_steps", "gc_every_steps")


_INIT_METHODS = ("env://", "tcp://", "file://")


@dataclass
class DistEnvConfig:
    master_addr: str | None = field(default=None, metadata=_help(
        "rendezvous address of the processes --nproc-per-node starts (torchrun's --master-addr; the command line's "
        "--master-addr wins; default localhost)"))
    master_port: int | None = field(default=None, metadata=_help(
        "rendezvous port of the processes --nproc-per-node starts (torchrun's --master-port; the command line's "
        "--master-port wins; default 29500)"))
    init_method: str | None = field(default=None, metadata=_help(
        "how the processes find each other (torch.distributed.init_process_group's init_method): env:// (torchrun's "
        "MASTER_ADDR / MASTER_PORT, the default), tcp://host:port or file:///shared/path"))
    backend: Literal["nccl", "gloo"] | None = field(
        default=None, metadata=_help("torch.distributed backend (default: nccl on CUDA, gloo on CPU)"))
    timeout_minutes: float = field(default=30, metadata=_help(
        "how long a collective may wait for the other ranks before the run stops with an error naming the step"))
    cpu_malloc_tuning: bool = field(
        default=True, metadata=_help("on CPU with glibc, keep freed step buffers in the heap instead of returning "
                                     "them to the kernel each step (speed); under FSDP2 the opposite: every block "
                                     "of 256 KiB or more goes back to the kernel when freed (memory) "
                                     "(automodel.training.host_memory)"))

    def __post_init__(self) -> None:
        bad = {}
        if self.init_method is not None and not self.init_method.startswith(_INIT_METHODS):
            bad["init_method"] = (f"{self.init_method!r} is not a rendezvous URL torch.distributed reads: use "
                                  "env://, tcp://host:port or file:///path")
        elif self.init_method not in (None, "env://") and (self.master_addr or self.master_port):
            bad["init_method"] = (f"{self.init_method} names the rendezvous itself, so master_addr / master_port "
                                  "would not be used: give one of them")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            bad["master_port"] = f"must be a TCP port (1-65535), found {self.master_port}"
        if self.timeout_minutes <= 0:
            bad["timeout_minutes"] = f"must be > 0, found {self.timeout_minutes}"
        if bad:
            raise FieldErrors(bad)

    def rendezvous_issues(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Under a launcher that already chose the rendezvous (torchrun's MASTER_ADDR / MASTER_PORT), a different
        master_addr / master_port here could not act: the keys that disagree, with why."""
        issues: dict[str, str] = {}
        if int(environ.get("WORLD_SIZE", "1")) <= 1:
            return issues  # no launcher's rendezvous: one process, or a launch still to come (--nproc-per-node)
        for key, variable in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
            value = getattr(self, key)
            if value is not None and variable in environ and str(value) != environ[variable]:
                issues[key] = (f"{value} but this process was started with {variable}={environ[variable]} (the "
                               f"launcher's rendezvous, which every process already uses): remove the key or give "
                               f"the launcher --{key.replace('_', '-')} {value}")
        return issues


@dataclass
class RngConfig:
    accepted_targets: ClassVar[dict] = {"StatefulRNG": {}}
    seed: int = field(default=42, metadata=_help("seed for python, numpy and torch"))
    ranked: bool = field(default=False, metadata=_help(
        "offset the seed by the process rank for training (dropout, noise; the ranks of one tensor-parallel group "
        "by their group's index, so that they draw alike); the model and its pipeline are built under the seed "
        "itself, so freshly initialised tensors (a new head, LoRA's) are alike on every rank"))
    deterministic: bool = field(default=False, metadata=_help(
        "torch.use_deterministic_algorithms for the run: an operation with no deterministic implementation stops "
        "the run with torch's error instead of running nondeterministically (on CUDA also cuBLAS's reproducible "
        "workspace and no cuDNN autotuning)"))


@dataclass
class CompileConfig:
    enabled: bool = field(default=False, metadata=_help("wrap the model with torch.compile"))
    backend: str | None = field(default="inductor", metadata=_help("torch.compile backend (null: inductor)"))
    mode: str | None = field(default=None, metadata=_help("torch.compile mode (default, reduce-overhead, ...)"))
    fullgraph: bool = field(default=False, metadata=_help("require a single graph"))
    dynamic: bool | None = field(default=None, metadata=_help("dynamic shapes (None: let torch decide)"))


@dataclass
class ClipGradConfig:
    max_norm: float | None = field(default=None, metadata=_help("clip the global gradient norm to this (None: off)"))
    norm_type: float = field(default=2.0, metadata=_help("p of the p-norm"))


# save_consolidated's values: upstream's bools and its strings (every = true); final stays "final".
_CONSOLIDATED = {True: True, "true": True, "every": True, False: False, "false": False, "final": "final"}


@dataclass
class CheckpointConfig:
    # upstream's other keys, which choose nothing here: (values accepted, being what happens, why any other is
    # refused)
    upstream_refused: ClassVar[dict[str, tuple[tuple, str]]] = {
        "wait_for_staging": ((False, None), "async_save here always finishes its host copies before training goes "
                                            "on (what true asks), so the key chooses nothing: remove it"),
        "cpu_offload": ((False, None), "each rank streams its shards to their files one tensor at a time "
                                       "(async_save: true copies them to host memory first): there is no separate "
                                       "offload step to turn on; remove it"),
        "allow_legacy_pickle_restore": ((False, None), "a checkpoint here is never unpickled (a config and a "
                                                       "checkpoint are untrusted data); restore from a safetensors "
                                                       "checkpoint"),
        "single_rank_consolidation": ((False, None), "model/ is written by every rank from its own shards, so no "
                                                     "rank gathers the whole model; remove it"),
        "staging_dir": ((None,), "a checkpoint is written into .incomplete-<name> under checkpoint_dir and renamed "
                                 "when complete; there is no other staging directory: remove it"),
        "original_model_root_dir": ((None,), "model/'s config, tokenizer and code come from the model trained; "
                                             "remove it"),
        "best_metric_key": ((None,), "no best-checkpoint pointer (upstream's LOWEST_VAL) is kept: LATEST names the "
                                     "newest checkpoint and validation.jsonl every validation's metrics; remove it"),
        "consolidation_timeout_minutes": ((None,), "a checkpoint's collectives wait dist_env.timeout_minutes like "
                                                   "every other: set that instead"),
        "skip_task_head_prefixes_for_base_model": ((None,), "names a task head over a base model, which only the "
                                                            "sequence-classification recipe (finetune seq-cls, "
                                                            "upstream's TrainFinetuneRecipeForSequenceClassification) "
                                                            "has; remove it"),
        "model_state_dict_keys": ((None,), "upstream fills it itself (kept for its backward compatibility); there is "
                                          "nothing to set: remove it"),
    }
    enabled: bool = field(default=True, metadata=_help("write checkpoints"))
    checkpoint_dir: str = field(default="checkpoints", metadata=_help("where checkpoints and metrics go"))
    model_save_format: Literal["safetensors", "torch_save"] = field(default="safetensors", metadata=_help(
        "safetensors; torch_save (upstream's sharded DCP form, which it writes instead of model/): the weights only "
        "as the sharded form model_shards/, as save_consolidated: false (automodel export makes model/); its files "
        "are safetensors here too, a checkpoint here is never unpickled"))
    save_consolidated: bool | Literal["every", "final", "true", "false"] | None = field(default=None, metadata=_help(
        "true (upstream's every; the default): model/ in the Hugging Face layout in every checkpoint (written by "
        "every rank from its shards, the weights' only copy); false (the default with model_save_format: "
        "torch_save): only the sharded form model_shards/ (automodel export makes model/ later); final: "
        "model_shards/, and model/ in the run's last checkpoint"))
    async_save: bool = field(default=False, metadata=_help(
        "write checkpoints in the background from host copies while training goes on; LATEST names one once "
        "every file is written", ("is_async",)))
    keep_last: int | None = field(default=None, metadata=_help("keep only the newest N checkpoints",
                                                               ("max_recent_checkpoints",)))
    diffusers_compatible: bool | None = field(default=None, metadata=_help(
        "true: model/ loads with diffusers' from_pretrained, which is what the diffusion recipe writes (refused "
        "for the other recipes, and false for the diffusion recipe)"))
    model_repo_id: str | None = field(default=None, metadata=_help(
        "refused: upstream fills it from model: (a YAML value never acts there); model/ comes from the model trained"))
    model_cache_dir: str | None = field(default=None, metadata=_help(
        "refused: upstream fills it from model: (a YAML value never acts there); model/ comes from the model trained"))
    is_peft: bool | None = field(default=None, metadata=_help(
        "refused: upstream fills it from peft: (a YAML value never acts there); peft: decides here too"))
    v4_compatible: bool = field(default=False, metadata=_help(
        "model/config.json and generation_config.json as the pretrained model ships them (for transformers 4 and "
        "the servers built on it), without its quantization_config and with the saved special-token ids; "
        "transformers 5's kept as config.v5.json / generation_config.v5.json (needs "
        "model.pretrained_model_name_or_path; not with peft:, whose model/ is the adapter)"))
    dequantize_base_checkpoint: bool | None = field(default=None, metadata=_help(
        "checked against the base model at setup: a quantized base (quantization_config) is refused, since this "
        "build loads no quantized weights; otherwise there is nothing to dequantize and the run says so"))
    def __post_init__(self) -> None:
        errors = {}
        if self.model_save_format == "torch_save" and self.save_consolidated not in (None, False, "false"):
            errors["save_consolidated"] = (
                f"{str(self.save_consolidated).lower()}: writes model/ in the Hugging Face layout, but "
                "model_save_format: "
                "torch_save keeps the weights only in the sharded form (upstream then ignores save_consolidated); "
                "remove one of the two")
        if self.save_consolidated is not None:
            self.save_consolidated = _CONSOLIDATED[self.save_consolidated]
        for name, section in (("model_repo_id", "model:"), ("model_cache_dir", "model:"), ("is_peft", "peft:")):
            if getattr(self, name) is not None:
                errors[name] = (f"upstream sets {name} from {section} and never reads this value; here too the run "
                                f"takes it from {section}, so there is nothing to set: remove the key")
        try:
            require_positive(self, "keep_last")
        except FieldErrors as err:
            errors.update(err.errors)
        if errors:
            raise FieldErrors(errors)

    def consolidated(self) -> bool | Literal["final"]:
        """save_consolidated as it acts: its value, or when unset, true (false with model_save_format: torch_save)."""
        if self.save_consolidated is not None:
            return self.save_consolidated
        return self.model_save_format != "torch_save"

    def sharded_only_setting(self) -> tuple[str, str, str] | None:
        """When the weights are kept only in the sharded form: the key that asks for it, its value and how to undo
        it (for messages); None when checkpoints hold model/."""
        if self.consolidated() is not False:
            return None
        if self.model_save_format == "torch_save":
            return "checkpoint.model_save_format", "torch_save", "set it to safetensors"
        return "checkpoint.save_consolidated", "false", "set it to true"

    def no_sharded_form_issues(self, writer: str) -> list[ConfigIssue]:
        """The sharded form asked for where ``writer`` (what writes model/, and how) makes a model/ that has none."""
        setting = self.sharded_only_setting()
        if setting is None:
            return []
        key, value, undo = setting
        return [ConfigIssue(key, f"{value}: {writer}, which has no sharded form; remove the key (or {undo})")]


@dataclass
class RestoreConfig:
    path: str | None = field(default=None, metadata=_help(
        "checkpoint to resume from: a path, a directory name under checkpoint_dir, or 'latest'"))


@dataclass
class FreezeConfig:
    patterns: list[str] = field(default_factory=list, metadata=_help("glob patterns of parameter names to freeze"))
    unfreeze_modules: list[str] = field(
        default_factory=list, metadata=_help("glob patterns kept trainable even if a freeze pattern matches"))
    embeddings: bool = field(default=False, metadata=_help("freeze the input embeddings"))

    def freezes_anything(self) -> bool:
        """Whether these settings freeze something (the freeze stage then acts even without a freeze: section)."""
        return bool(self.patterns) or self.embeddings


@dataclass
class FP8Config:
    enabled: bool = field(default=False, metadata=_help("float8 training through torchao (needs a capable GPU)"))
    recipe_name: str | None = field(default=None, metadata=_help("torchao float8 recipe (tensorwise, rowwise)"))
    filter_fqns: list[str] = field(default_factory=list, metadata=_help(
        "linear layers whose name contains one of these stay in high precision (layers with a dimension not "
        "divisible by 16 always do)"))
    emulate: bool = field(default=False, metadata=_help("torchao's emulated float8 matmuls (for testing)"))
    enable_fsdp_float8_all_gather: bool = field(default=False, metadata=_help(
        "FSDP2 gathers the weights in float8 (tensorwise scaling)"))
    force_recompute_fp8_weight_in_bwd: bool = field(default=False, metadata=_help(
        "recompute the float8 weights in backward instead of keeping them"))
    precompute_float8_dynamic_scale_for_fsdp: bool = field(default=False, metadata=_help(
        "refused when true: upstream computes the float8 all-gather scales once after each optimizer step; not "
        "implemented here (each layer computes its scale itself, the same values)"))


@dataclass
class FaultToleranceConfig:
    nonfinite: Literal["raise", "skip"] = field(
        default="raise", metadata=_help("a NaN/inf loss or gradient norm: stop the run (raise) or skip that update"))
    max_skipped_steps: int | None = field(
        default=None, metadata=_help("with nonfinite: skip, stop after this many skipped steps"))

    def __post_init__(self) -> None:
        if self.max_skipped_steps is not None and self.nonfinite != "skip":
            raise FieldErrors({"max_skipped_steps": f"counts skipped steps, and with nonfinite: {self.nonfinite} no "
                                                    "step is skipped: set nonfinite: skip, or remove it"})


@dataclass
class SlurmConfig:
    job_name: str = field(default="automodel", metadata={"help": "#SBATCH --job-name"})
    nodes: int = field(default=1, metadata={"help": "#SBATCH --nodes"})
    gpus_per_node: int = field(default=8, metadata={"help": "processes (GPUs) per node for torchrun"})
    partition: str | None = field(default=None, metadata={"help": "#SBATCH --partition"})
    account: str | None = field(default=None, metadata={"help": "#SBATCH --account"})
    time: str = field(default="04:00:00", metadata={"help": "#SBATCH --time"})
    master_port: int = field(default=29500, metadata={"help": "rendezvous port on the first node"})
    output: str = field(default="slurm-%j.out", metadata={"help": "#SBATCH --output"})
    script: str = field(default="automodel.sbatch", metadata={"help": "where the script is written"})

    def __post_init__(self) -> None:
        bad = {}
        for name in ("job_name", "partition", "account", "time", "output"):
            value = getattr(self, name)
            if value is not None and not _SBATCH_VALUE.match(value):
                bad[name] = (f"{value!r} cannot go into an #SBATCH line: use letters, digits and . _ : @ % / + , = ~ - "
                             "only (no spaces, quotes or control characters such as a newline)")
        if _CONTROL.search(self.script):
            bad["script"] = f"{self.script!r} holds a control character; name a plain file path"
        try:
            require_positive(self, "nodes", "gpus_per_node", "master_port")
        except FieldErrors as err:
            bad.update(err.errors)
        if bad:
            raise FieldErrors(bad)
