"""TrainRecipe: the one training loop (DESIGN §9), shared by every domain.

A domain subclasses it and overrides what differs — how a micro-batch becomes a summed loss
(``compute_loss``), how label tokens are counted, the collate function, its sections and builders — never the
loop itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm import tqdm

from automodel.cli.slurm import SlurmConfig
from automodel.config import Config, ConfigNode, Free, Target
from automodel.errors import AutomodelError, ConfigIssue, PluginError
from automodel.plugins.manager import get_plugin_manager
from automodel.recipe import BaseRecipe
from automodel.training import sections as s
from automodel.training.checkpoint import (
    Checkpointer,
    load_safetensors_dir,
    load_weights_into,
    read_latest,
    save_state_dict_safetensors,
)
from automodel.training.distributed import (
    all_reduce_sum,
    any_rank,
    distributed_sampler,
    init_process_group,
    is_distributed,
    is_fsdp2,
    pipeline_issues,
    strategy_issues,
    world_size,
)
from automodel.training.host_memory import keep_freed_memory_in_heap
from automodel.training.loggers import FAILED, STOPPED, SUCCESS, LoggerContext, MetricLoggers, resolve_backends
from automodel.training.metrics import JsonlWriter, MetricsSample, device_peak_flops, peak_memory_gib
from automodel.training.pipeline import apply_pipeline, missing_stages
from automodel.training.rng import StatefulRNG
from automodel.training.signals import StopRequest, TrainingStopped

# Third-party deprecation chatter on every run (torchdata's set_vital; torchao's enum registration, which
# transformers triggers on import when torchao is installed) is noise for users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

_DATALOADER = Target("data loading (a StatefulDataLoader's keyword arguments)", runtime_args=("dataset",),
                     plain=True, default_target="torchdata.stateful_dataloader.StatefulDataLoader")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class TrainRecipe(BaseRecipe):
    """Builds model, data, optimizer and schedulers from config, applies the pipeline, trains and validates."""

    domain: ClassVar[str | None] = None
    hf_artifacts: ClassVar[tuple[str, ...]] = ("tokenizer", "processor")  # saved beside the weights in model/

    sections = {
        "step_scheduler": s.StepSchedulerConfig,
        "dist_env": s.DistEnvConfig,
        "rng": s.RngConfig,
        "model": Target("the model to train: {_target_: ..., ...}", required=True),
        "compile": s.CompileConfig,
        "clip_grad_norm": s.ClipGradConfig,
        "distributed": s.DistributedConfig,
        "loss_fn": Target("the loss (the engine sums it over label tokens)"),
        "dataset": Target("the training data set", required=True),
        "validation_dataset": Target("a validation data set"),
        "validation_dataset_*": Target("more validation data sets, reported by name"),
        "dataloader": _DATALOADER,
        "validation_dataloader": _DATALOADER,
        "optimizer": Target("the optimizer (default torch.optim.AdamW, lr 1e-5)", runtime_args=("params",)),
        "lr_scheduler": Target("learning-rate schedule: {_target_: ...} or upstream keys (lr_decay_style, ...)",
                               runtime_args=("optimizer",), plain=True,
                               default_target="automodel.optim.build_scheduler"),
        "fault_tolerance": s.FaultToleranceConfig,
        "slurm": SlurmConfig,
        "ci": Free("upstream CI metadata; accepted and ignored (a note says so)"),
        "logging": Free("metric logging backends: {backends: [tensorboard, mlflow, wandb], <backend>: {settings}}; "
                        "see docs/logging.md (checked by validation against the registered backends)"),
        "wandb": Free("upstream-style Weights & Biases settings {project, entity, name, save_dir, mode, ...}: the "
                      "same as logging.wandb (enable: false turns it off)"),
        "mlflow": Free("upstream-style MLflow settings {experiment_name, run_name, tracking_uri, tags, ...}: the "
                       "same as logging.mlflow (enable: false turns it off)"),
        "checkpoint": s.CheckpointConfig,
        "restore_from": s.RestoreConfig,
        "peft": Target("parameter-efficient fine-tuning (LoRA)", plain=True),
        "fp8": s.FP8Config,
        "qat": s.QATConfig,
        "freeze": s.FreezeConfig,
    }

    # ---- validation (classmethods: they run before anything is built) --------------------------------------

    @classmethod
    def batch_layout(cls, cfg: Config) -> tuple[int, int, int, list[ConfigIssue]]:
        """(micro batch size, dp size, grad accumulation steps) and the arithmetic problems found."""
        issues: list[ConfigIssue] = []
        steps = cfg.step_scheduler
        loader = cfg.dataloader
        batch_size = loader.get("batch_size") if loader is not None else None
        local = steps.local_batch_size if steps else None
        if batch_size is not None and local is not None and batch_size != local:
            issues.append(ConfigIssue("step_scheduler.local_batch_size",
                                      f"{local} disagrees with dataloader.batch_size={batch_size}; set one of them"))
        batch_size = batch_size or local or 1
        dist = cfg.distributed
        dp = dist.dp_size if dist is not None and isinstance(dist.dp_size, int) else world_size()
        if steps is None:
            return batch_size, dp, 1, issues
        accumulation, global_size = steps.grad_accumulation_steps, steps.global_batch_size
        if global_size is not None:
            if accumulation is not None and global_size != batch_size * dp * accumulation:
                issues.append(ConfigIssue(
                    "step_scheduler.global_batch_size",
                    f"{global_size} != batch_size ({batch_size}) * dp_size ({dp}) * grad_accumulation_steps "
                    f"({accumulation}) = {batch_size * dp * accumulation}; fix one of the three"))
            elif accumulation is None:
                if global_size % (batch_size * dp):
                    issues.append(ConfigIssue(
                        "step_scheduler.global_batch_size",
                        f"{global_size} is not divisible by batch_size ({batch_size}) * dp_size ({dp}) = "
                        f"{batch_size * dp}, so grad_accumulation_steps cannot be derived"))
                accumulation = max(1, global_size // (batch_size * dp))
        return batch_size, dp, accumulation or 1, issues

    @classmethod
    def pipeline_selection(cls, cfg: Config) -> dict[str, tuple[str, str]]:
        """slot -> (implementation name, config key that asked for it), for the stages this config uses."""
        chosen: dict[str, tuple[str, str]] = {}
        if cfg.peft is not None:
            chosen["peft"] = ("lora", "peft")
        if cfg.fp8 is not None and cfg.fp8.enabled:
            chosen["fp8"] = ("torchao", "fp8.enabled")
        if cfg.qat is not None and cfg.qat.enabled:
            chosen["qat"] = ("torchao", "qat.enabled")
        if cfg.restore_from is not None and cfg.restore_from.path:
            chosen["checkpoint"] = ("restore", "restore_from.path")
        if "freeze" in cfg:
            chosen["freeze"] = ("patterns", "freeze")
        dist = cfg.distributed
        if dist is not None and world_size() > 1:
            chosen["sharding"] = (dist.strategy, "distributed.strategy")
        chosen["device"] = ("single", "dist_env")
        if cfg.compile is not None and cfg.compile.enabled:
            chosen["compile"] = ("torch", "compile.enabled")
        return chosen

    @classmethod
    def check_config(cls, cfg: Config) -> list[ConfigIssue]:
        issues = list(super().check_config(cfg))
        issues += cls.batch_layout(cfg)[3]
        for name in ("dataloader", "validation_dataloader"):
            loader = cfg.get(name)
            size = loader.get("batch_size") if isinstance(loader, ConfigNode) else None
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                issues.append(ConfigIssue(f"{name}.batch_size", f"must be a positive integer, found {size!r}"))
        dist = cfg.distributed
        if dist is not None:
            for name in ("tp_size", "pp_size"):
                if getattr(dist, name) > 1:
                    issues.append(ConfigIssue(f"distributed.{name}", f"{getattr(dist, name)} is not supported yet; "
                                                                     "only data parallelism (dp_size) is"))
        if dist is not None:
            issues += strategy_issues(dist.strategy)
        issues += pipeline_issues(cfg)
        issues += missing_stages(cls.pipeline_selection(cfg), get_plugin_manager().stages)
        issues += resolve_backends(cfg, get_plugin_manager().loggers)[1]
        return issues

    @classmethod
    def describe_plan(cls, cfg: Config) -> list[str]:
        batch_size, dp, accumulation, _ = cls.batch_layout(cfg)
        steps = cfg.step_scheduler
        lines = [f"recipe: {cls.__module__}.{cls.__qualname__}",
                 f"model: {cfg.model.target}",
                 f"dataset: {cfg.dataset.target if cfg.dataset is not None else 'built by the recipe'}"]
        lines += [f"{name}: {cfg.get(name).target}" for name in cfg.section_names()
                  if name.startswith("validation_dataset") and isinstance(cfg.get(name), ConfigNode)]
        lines += [f"batch: {batch_size} per micro-batch x {dp} ranks x {accumulation} accumulation = "
                  f"{batch_size * dp * accumulation} samples per step",
                  f"steps: max_steps={steps.max_steps} num_epochs={steps.num_epochs} "
                  f"val every {steps.val_check_interval} ckpt every {steps.checkpoint_interval}",
                  f"optimizer: {cfg.optimizer.target if cfg.optimizer else 'torch.optim.AdamW (default)'}"]
        lines += [f"pipeline {slot}: {name}" for slot, (name, _) in cls.pipeline_selection(cfg).items()]
        ckpt = cfg.checkpoint
        lines.append(f"checkpoints: {ckpt.checkpoint_dir}" if ckpt.enabled else "checkpoints: disabled")
        backends = [spec.name for spec in resolve_backends(cfg, get_plugin_manager().loggers)[0]]
        if backends:
            lines.append(f"logging: {', '.join(backends)}")
        return lines

    # ---- what a domain overrides ----------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The micro-batch's loss *summed* over its label tokens (the loop divides by the step's count)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(model, batch)")

    def count_label_tokens(self, batch: Any) -> int:
        """How many targets ``compute_loss`` sums over (samples by default)."""
        first = next(iter(batch.values())) if isinstance(batch, dict) else batch
        return len(first)

    def count_input_tokens(self, batch: Any) -> int:
        """Tokens processed, for tokens/s (defaults to the label count)."""
        return self.count_label_tokens(batch)

    def default_collate_fn(self, train: bool = True) -> Any:
        return None  # torch's default collate

    def default_loss_fn(self) -> torch.nn.Module | None:
        return None

    def model_runtime_args(self) -> dict[str, Any]:
        return {}

    def dataset_runtime_args(self) -> dict[str, Any]:
        return {}

    def data_sampler(self, dataset: Any, shuffle: bool, generator: torch.Generator) -> Any:
        """A sampler for ``dataset`` (None: the loader's own); under torchrun each rank reads its own shard."""
        return distributed_sampler(dataset, shuffle, self.cfg.rng.seed)

    def setup_domain(self) -> None:
        """Build what the domain needs before the model (a tokenizer, say)."""

    def extra_validation_metrics(self, name: str, dataloader: Any) -> dict[str, float]:
        return {}

    def after_step(self, step: int, tokens: int, seconds: float) -> None:
        """Called after every optimizer step with its input tokens and wall time (benchmarks use it)."""

    def on_train_end(self, final_checkpoint: Path | None) -> None:
        if final_checkpoint is not None:
            self.log(f"final checkpoint: {final_checkpoint}")

    # ---- building -------------------------------------------------------------------------------------------

    def build(self, name: str, *args: Any) -> Any:
        registry = get_plugin_manager().builders
        try:
            return registry.get(name, self.domain)(self, *args)
        except AutomodelError:
            raise
        except Exception as err:  # a plugin's builder failed: name the plugin (the core's own propagate as they are)
            entry = registry.builders.get((name, self.domain)) or registry.builders.get((name, None))
            if entry is None or entry.source in ("core", "automodel-core"):
                raise
            raise PluginError(f"builder '{name}' registered by plugin '{entry.source}' failed: "
                              f"{type(err).__name__}: {err} (AUTOMODEL_DEBUG=1 shows the traceback)") from err

    def log(self, message: str) -> None:
        if self.is_main_process:
            tqdm.write(message, file=sys.stderr)

    def select_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def build_dataset(self, node: ConfigNode) -> Any:
        from automodel.training.builders import instantiate_with

        dataset = instantiate_with(node, self.dataset_runtime_args())
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            raise AutomodelError(f"{node.key}: the data set is empty; check its path and filters")
        return dataset

    def setup(self) -> None:
        cfg = self.cfg
        self.is_main_process = int(os.environ.get("RANK", "0")) == 0
        init_process_group(cfg.dist_env.backend, cfg.dist_env.timeout_minutes, self.log)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = world_size()
        self.device = self.select_device()
        if self.device.type == "cpu" and cfg.dist_env.cpu_malloc_tuning and keep_freed_memory_in_heap():
            self.log("host memory: glibc malloc keeps freed step buffers in the heap (dist_env.cpu_malloc_tuning)")
        self.micro_batch_size, self.dp_size, self.grad_accumulation_steps, _ = self.batch_layout(cfg)
        self.rng = StatefulRNG(cfg.rng.seed, cfg.rng.ranked, self.rank)
        self.checkpointer: Checkpointer = self.build("checkpoint_config")
        self.restore_path: Path | None = None
        if cfg.checkpoint.enabled and self.is_main_process:
            self.checkpointer.prepare()
        if cfg.restore_from is not None and cfg.restore_from.path:
            self.checkpointer.resolve(cfg.restore_from.path)  # a missing checkpoint fails before anything is built
        if "ci" in cfg:
            self.log("note: section 'ci' is upstream CI metadata and is ignored")
        self.setup_domain()
        model = self.build("model")
        stages = get_plugin_manager().stages
        self.model = apply_pipeline(self, model, self.pipeline_selection(cfg), stages, self.log)
        self.loss_fn = self.build("loss_fn")
        self.untrack("loss_fn")
        self.optimizer = self.build("optimizer", self.model)
        self.train_dataset = self.build_dataset(cfg.dataset)
        self.untrack("train_dataset")
        self.dataloader = self.build("dataloader", self.train_dataset, cfg.dataloader, True)
        self.val_dataloaders = {
            name.removeprefix("validation_dataset_") if name != "validation_dataset" else "validation":
                self.build("dataloader", self.build_dataset(cfg.get(name)), cfg.validation_dataloader, False)
            for name in cfg.section_names()
            if (name == "validation_dataset" or name.startswith("validation_dataset_")) and cfg.get(name) is not None
        }
        per_epoch = len(self.dataloader) // self.grad_accumulation_steps if hasattr(self.dataloader, "__len__") \
            else None
        self.step_scheduler = self.build("step_scheduler", per_epoch)
        self.lr_scheduler = self.build("lr_scheduler", self.optimizer, self.step_scheduler.max_steps)
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]
        self.step_losses: list[float] = []
        self.skipped_steps = 0
        if self.restore_path is not None:
            self.restore_training_state(self.restore_path)
        root = Path(cfg.checkpoint.checkpoint_dir)
        self.train_log = JsonlWriter(root / "training.jsonl")
        self.val_log = JsonlWriter(root / "validation.jsonl")
        self.peak_flops = device_peak_flops(self.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        # Metric backends (rank 0 only); they start when training starts and close when it ends.
        specs = resolve_backends(cfg, get_plugin_manager().loggers)[0] if self.is_main_process else []
        self.metric_loggers = MetricLoggers(specs, LoggerContext(root, f"{type(self).__module__}."
                                                                    f"{type(self).__qualname__}", self.log))

    # ---- weights ---------------------------------------------------------------------------------------------

    def save_model(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """HF layout: ``save_pretrained`` when the model has it (safetensors), plus tokenizer/processor files."""
        model = unwrap(self.model)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(str(directory), state_dict=state_dict)
        else:
            save_state_dict_safetensors(state_dict or model.state_dict(), directory)
        for name in self.hf_artifacts:
            artifact = getattr(self, name, None)
            if artifact is not None and hasattr(artifact, "save_pretrained"):
                artifact.save_pretrained(str(directory))

    def load_model_weights(self, model: torch.nn.Module, directory: Path) -> None:
        load_weights_into(unwrap(model), load_safetensors_dir(directory), directory)

    def _full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights (gathered from every rank under FSDP2; a collective there)."""
        if is_fsdp2(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return None

    def checkpoint_states(self) -> dict[str, Any]:
        """State dicts of every tracked attribute but the weights and step counter (collective under FSDP2).

        The optimizer's is keyed by parameter name (torch.distributed.checkpoint's full form), so a checkpoint
        written by N ranks resumes on M.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        states = {}
        for name, obj in self.stateful_attributes().items():
            if name in ("model", "step_scheduler"):
                continue
            if name == "optimizer":
                states[name] = get_optimizer_state_dict(
                    self.model, obj, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            else:
                states[name] = obj.state_dict()
        return states

    def restore_training_state(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        trainer_state = Checkpointer.read_trainer_state(path)
        stateful = {k: v for k, v in self.stateful_attributes().items() if k not in ("model", "step_scheduler")}
        saved_world = trainer_state.get("world_size", 1)
        if saved_world != self.world_size and "dataloader" in stateful:
            self.log(f"restore: written by {saved_world} ranks, resuming on {self.world_size}: the data order "
                     "restarts at the current epoch's beginning")
            stateful.pop("dataloader")
        for name, state in Checkpointer.read_states(path, list(stateful)).items():
            if name == "optimizer":
                # strict=False: a trainable parameter that never received a gradient (a VLM's unused vision
                # head, say) has no optimizer state in the checkpoint, and the uninterrupted run had none either.
                set_optimizer_state_dict(self.model, self.optimizer, state,
                                         options=StateDictOptions(full_state_dict=True, strict=False))
            else:
                stateful[name].load_state_dict(state)
        self.step_scheduler.load_state_dict(trainer_state["step_scheduler"])
        self.step_losses = list(trainer_state.get("losses", []))
        self.log(f"resumed from {path} at step {self.step_scheduler.step}")

    # ---- the loop --------------------------------------------------------------------------------------------

    def move_to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self.move_to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.move_to_device(v) for v in batch)
        return batch

    def train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer update over the step's micro-batches; the loss is token-weighted over the whole step."""
        with self.batch_errors(batches[0], "dataloader"):
            label_tokens = sum(self.count_label_tokens(b) for b in batches)
            input_tokens = sum(self.count_input_tokens(b) for b in batches)
        if self.world_size > 1:
            # Every rank divides by the tokens of the whole step; DDP/FSDP average gradients over ranks,
            # which the world-size factor undoes, so N ranks equal one process accumulating N times as much.
            (global_tokens,) = all_reduce_sum(label_tokens, device=self.device)
            label_tokens = int(global_tokens.item())
        denominator = max(label_tokens, 1)
        scale = self.world_size / denominator
        total = torch.zeros((), device=self.device)
        for batch in batches:
            with self.batch_errors(batch, "dataloader"):
                loss_sum = self.compute_loss(self.model, self.move_to_device(batch))
            (loss_sum * scale).backward()
            total += loss_sum.detach().float()
        if self.world_size > 1:
            (total,) = all_reduce_sum(total, device=self.device)
            total = total.float()
        max_norm = self.cfg.clip_grad_norm.max_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_params, max_norm,
                                                   norm_type=self.cfg.clip_grad_norm.norm_type)
        loss = total / denominator
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (logged)
        if not (torch.isfinite(grad_norm) and torch.isfinite(loss)):
            self._nonfinite(loss, grad_norm)
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, input_tokens

    def _nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A NaN/inf step: stop with where to resume from (policy raise) or skip its update (policy skip)."""
        step = self.step_scheduler.step + 1
        policy = self.cfg.fault_tolerance
        if policy.nonfinite == "skip":
            self.skipped_steps += 1
            self.log(f"step {step}: non-finite loss {loss.item()} / grad norm {grad_norm.item()}: update skipped "
                     f"({self.skipped_steps} so far)")
            if policy.max_skipped_steps is None or self.skipped_steps <= policy.max_skipped_steps:
                return
        last = read_latest(self.checkpointer.root) if self.cfg.checkpoint.enabled else None
        where = f"the last good checkpoint is {last} (resume with --restore_from.path {last})" if last else \
            "no checkpoint was written before it"
        raise AutomodelError(f"step {step}: the loss is {loss.item()} and the gradient norm {grad_norm.item()}; "
                             f"training stopped (fault_tolerance.nonfinite: {policy.nonfinite}); {where}. Lower "
                             "optimizer.lr or set clip_grad_norm.max_norm")

    @contextlib.contextmanager
    def batch_errors(self, batch: Any, loader_key: str):
        """A batch that does not fit what compute_loss / count_label_tokens read: say so, describing the batch."""
        try:
            yield
        except AutomodelError:
            raise
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            from automodel.training.builders import describe_batch

            name = type(self).__name__
            raise AutomodelError(
                f"the batch does not fit {name}.compute_loss / count_label_tokens: {type(err).__name__}: {err}. "
                f"The batch is {describe_batch(batch)}; it is what {loader_key}.collate_fn returns (the recipe's "
                "default when unset). Remove collate_fn, or make it return the keys and tensors the recipe reads; "
                "AUTOMODEL_DEBUG=1 shows the traceback") from err

    @contextlib.contextmanager
    def validation_oom(self, name: str, loader: Any):
        """Running out of memory in validation only (training fit): point at the validation batch size."""
        try:
            yield
        except RuntimeError as err:  # torch.OutOfMemoryError (CUDA) is a RuntimeError; so is a failed CPU alloc
            text = str(err)
            if not (isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower()
                    or "can't allocate memory" in text):
                raise
            first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
            size = getattr(loader, "batch_size", None)
            raise AutomodelError(
                f"validation [{name}] at step {self.step_scheduler.step} ran out of memory with batch size {size}: "
                f"{type(err).__name__}: {first[:300]}. Training fit, so lower validation_dataloader.batch_size "
                "(it defaults to dataloader.batch_size) or shorten the validation samples; validation runs "
                "under torch.no_grad() in eval mode") from err

    @torch.no_grad()
    def validate(self) -> None:
        self.model.eval()
        try:
            for name, loader in self.val_dataloaders.items():
                total = torch.zeros((), device=self.device)
                tokens = 0
                for batch in loader:
                    with self.batch_errors(batch, "validation_dataloader"), self.validation_oom(name, loader):
                        tokens += self.count_label_tokens(batch)
                        total += self.compute_loss(self.model, self.move_to_device(batch)).float()
                record = {"step": self.step_scheduler.step, "epoch": self.step_scheduler.epoch, "name": name,
                          "val_loss": total.item() / max(tokens, 1), "num_label_tokens": tokens}
                record.update(self.extra_validation_metrics(name, loader))
                record["timestamp"] = time.time()
                if self.is_main_process:
                    self.val_log.write(record)
                    self.metric_loggers.log_validation(record, record["step"])
                shown = ", ".join(f"{k}={v:.4f}" for k, v in record.items()
                                  if isinstance(v, float) and k != "timestamp")
                self.log(f"validation [{name}] step {record['step']}: {shown}")
        finally:
            self.model.train()

    def save_checkpoint(self) -> Path | None:
        """Every rank gathers (FSDP2 needs all of them); rank 0 writes."""
        if not self.cfg.checkpoint.enabled:
            return None
        weights = self._full_model_state()
        states = self.checkpoint_states()
        path = None
        if self.is_main_process:
            steps = self.step_scheduler
            trainer_state = {"step": steps.step, "epoch": steps.epoch, "losses": self.step_losses,
                             "world_size": self.world_size, "step_scheduler": steps.state_dict()}
            path = self.checkpointer.save(states, lambda d: self.save_model(d, weights), trainer_state,
                                          steps.epoch, steps.step)
            self.log(f"checkpoint: {path}")
        if is_distributed():
            torch.distributed.barrier()
        return path

    def _sample(self, loss: float, grad_norm: torch.Tensor, tokens: int, elapsed: float) -> MetricsSample:
        tps = tokens / elapsed if elapsed > 0 else 0.0
        mfu = 6 * self.num_params * tps / self.peak_flops if self.peak_flops else None
        return MetricsSample(step=self.step_scheduler.step, epoch=self.step_scheduler.epoch, loss=loss,
                             grad_norm=float(grad_norm), lr=self.step_lr,
                             mem=peak_memory_gib(self.device), tps=tps, mfu=mfu)

    def _stop(self, stop: StopRequest, saved: bool) -> None:
        path = self.final_checkpoint if saved else self.save_checkpoint()
        name = {2: "SIGINT", 15: "SIGTERM"}.get(stop.signum, f"signal {stop.signum}")
        where = f"checkpoint: {path}; resume with --restore_from.path latest" if path else "no checkpoint (disabled)"
        raise TrainingStopped(stop.signum, f"stopped by {name} after step {self.step_scheduler.step}; {where}")

    def run_train_validation_loop(self) -> None:
        steps = self.step_scheduler
        self.model.train()
        progress = tqdm(total=steps.max_steps, initial=steps.step, desc="train", unit="step", file=sys.stderr,
                        disable=not self.is_main_process, dynamic_ncols=True)
        window_tokens, window_start = 0, time.perf_counter()
        saved_at = None
        self.final_checkpoint: Path | None = None
        status = FAILED  # what the metric backends are told when the loop ends
        with StopRequest() as stop:
            try:
                self.metric_loggers.open(self.cfg.raw)  # secrets are masked before any backend sees the config
                step_start = time.perf_counter()
                for batches in steps.batches(self.dataloader):
                    loss, grad_norm, tokens = self.train_step(batches)
                    step = steps.finish_step()
                    self.after_step(step, tokens, time.perf_counter() - step_start)
                    window_tokens += tokens
                    progress.update(1)
                    if steps.is_log_step():
                        self._log_step(loss.item(), grad_norm, window_tokens, time.perf_counter() - window_start,
                                       progress)
                        window_tokens, window_start = 0, time.perf_counter()
                    if steps.is_val_step() and self.val_dataloaders:
                        self.validate()
                    if steps.is_checkpoint_step(last=step >= steps.max_steps):
                        saved_at = step
                        self.final_checkpoint = self.save_checkpoint()
                    if any_rank(stop.requested, self.device) if self.world_size > 1 else stop.requested:
                        self._stop(stop, saved=saved_at == step)
                    step_start = time.perf_counter()
                if saved_at != steps.step and steps.step > 0:
                    self.final_checkpoint = self.save_checkpoint()
                if self.final_checkpoint is not None:
                    self.metric_loggers.log_model(self.final_checkpoint / "model")
                status = SUCCESS
            except TrainingStopped:
                status = STOPPED
                raise
            finally:
                progress.close()
                self.checkpointer.wait()
                self.train_log.close()
                self.val_log.close()
                self.metric_loggers.close(status)
        self.on_train_end(self.final_checkpoint)

    def _log_step(self, loss: float, grad_norm: torch.Tensor, tokens: int, elapsed: float, progress: tqdm) -> None:
        self.step_losses.append(loss)
        sample = self._sample(loss, grad_norm, tokens, elapsed)
        record = sample.to_dict()
        if self.cfg.fault_tolerance.nonfinite == "skip":
            record["skipped_steps"] = self.skipped_steps
        if self.is_main_process:
            self.train_log.write(record)
            self.metric_loggers.log_train(record, record["step"])
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{sample.lr:.2e}", tps=f"{sample.tps:.0f}", refresh=False)
