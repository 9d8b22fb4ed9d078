"""The one training loop (DESIGN §9): steps, the token-weighted loss, validation, checkpoints, metrics, stops.

``TrainingLoop`` is a base of ``TrainRecipe``; it runs what ``setup`` built (``self.model``, ``self.optimizer``,
``self.dataloader``, ...) and calls the recipe's override points (``compute_loss``, ``count_label_tokens``,
``extra_validation_metrics``, ``after_step``, ``on_train_end``, ``save_model``). Domains never copy it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from automodel.errors import AutomodelError
from automodel.model_backend import backend_setting
from automodel.training.builders import describe_batch
from automodel.training.checkpoint import read_latest
from automodel.training.checkpoint_write import CheckpointParts, CheckpointWrite
from automodel.training.context_steps import ContextParallelSteps
from automodel.training.dist import all_reduce_sum, any_rank, naming_stalls
from automodel.training.distributed_section import grad_sync_deferred
from automodel.training.garbage import PeriodicGarbageCollection
from automodel.training.logging import FAILED, STOPPED, SUCCESS
from automodel.training.loss_parts import LossParts
from automodel.training.metrics import MetricsSample, peak_memory_gib
from automodel.training.modules import unwrap
from automodel.training.out_of_memory import training_out_of_memory, validation_out_of_memory
from automodel.training.parallel.grad_norm import clip_grad_norm_
from automodel.training.parallel.mesh import CP, DP, PP
from automodel.training.parallel.tensor_parallel import local_loss, tensor_parallel_of
from automodel.training.pipeline_steps import PipelineSteps
from automodel.training.progress import Progress
from automodel.training.signals import StopRequest, TrainingStopped
from automodel.training.state import small_states
from automodel.training.trainer_state import FORMAT as TRAINER_STATE_FORMAT
from automodel.training.trainer_state import encode_losses


class TrainingLoop(PipelineSteps, ContextParallelSteps, LossParts):
    """The loop and its events; the attributes it reads are built by ``TrainRecipe.setup``."""

    def move_to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self.move_to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.move_to_device(v) for v in batch)
        return batch

    def data_parallel_group(self) -> Any:
        """The ranks that read different data and sum the loss's tokens: None (every rank) unless the mesh has
        model-parallel dimensions, then its ``dp`` group."""
        if self.ctx.mesh.dp == self.world_size:
            return None
        return self.ctx.device_mesh[DP].get_group()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around a loss computation and its backward: torch's ``loss_parallel`` where tensor parallelism keeps the
        logits sharded over the vocabulary, else nothing."""
        applied = tensor_parallel_of(unwrap(self.model))
        return applied.loss_context() if applied is not None else contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager:
        """What a forward runs under: ``torch.autocast`` where the precision asks for it (not under FSDP2's policy
        unless ``distributed.autocast_dtype``); the loss itself is always computed in float32."""
        return self.ctx.precision.forward_context(self.device.type, self.ctx.fsdp2)

    def train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer update over the step's micro-batches; the loss is token-weighted over the whole step."""
        with naming_stalls(lambda: f"step {self.step_scheduler.step + 1}", self.cfg.dist_env.timeout_minutes), \
                training_out_of_memory(lambda: self.step_scheduler.step + 1, lambda: describe_batch(batches[0])):
            return self._train_step(batches)

    def _train_step(self, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        with self.batch_errors(batches[0], "dataloader"):
            label_tokens = sum(self.count_label_tokens(b) for b in batches)
            input_tokens = sum(self.count_input_tokens(b) for b in batches)
        dp, cp = self.ctx.mesh.dp, self.ctx.mesh.cp
        if dp > 1:
            # Every rank divides by the tokens of the whole step; DDP/FSDP average gradients over the data-parallel
            # ranks, which the dp factor undoes, so N ranks equal one process accumulating N times as much. The
            # ranks of one tensor- or context-parallel group read the same rows: only the data-parallel group is
            # summed (the tokens are counted before context parallelism splits the sequences).
            (global_tokens,) = all_reduce_sum(label_tokens, device=self.device, group=self.data_parallel_group())
            label_tokens = type(label_tokens)(global_tokens.item())  # a count, or a weight sum (float)
        denominator = label_tokens if label_tokens > 0 else 1
        scale = dp * cp / denominator  # FSDP2 averages over dp x cp ranks under context parallelism
        scaler = self.grad_scaler
        total = torch.zeros((), device=self.device)
        if self.pipelines is not None:
            total = self._pipelined(batches, scale)
        else:
            for index, batch in enumerate(batches):
                self.prepare_micro_batch(last=index == len(batches) - 1)
                # vocabulary-parallel cross entropy / context parallelism's region hold the loss and its backward
                with self.loss_context(), self.sequence_parts(batch) as part:
                    with self.batch_errors(batch, "dataloader"), self.forward_context():
                        loss_sum = local_loss(self.compute_loss(self.model, part))
                    scaled = loss_sum.float() * scale
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss_sum.detach().float()
        self.step_loss_parts = self.loss_parts_of_step(denominator)
        if dp > 1:
            (total,) = all_reduce_sum(total, device=self.device, group=self.data_parallel_group())
            total = total.float()
        if cp > 1:  # each context-parallel rank summed the loss over its part of the sequences
            (total,) = all_reduce_sum(total, device=self.device, group=self.ctx.device_mesh[CP].get_group())
            total = total.float()
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clipping and the reported norm see the true gradients
        max_norm = self.cfg.clip_grad_norm.max_norm or math.inf
        pp_group = self.ctx.device_mesh[PP].get_group() if self.pipelines is not None else None
        copy = self.tied_head.copy if self.tied_head is not None else None  # its gradient is the embedding's
        grad_norm = clip_grad_norm_(self.trainable_params, max_norm, norm_type=self.cfg.clip_grad_norm.norm_type,
                                    pp_group=pp_group, counted_elsewhere=[copy] if copy is not None else ())
        loss = total / denominator
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (logged)
        if not torch.isfinite(loss) or (scaler is None and not torch.isfinite(grad_norm)):
            self._nonfinite(loss, grad_norm)
        elif scaler is not None:
            self._scaled_update(scaler, grad_norm)
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, input_tokens

    def prepare_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch of a step (``last``: the step's final one). FSDP2 reduce-scatters the
        gradients after the step's last micro-batch only with ``distributed.defer_fsdp_grad_sync`` (upstream's default,
        true) or ``model.backend.enable_fsdp_optimizations: true`` (upstream's models with it defer whatever the former
        says; it also keeps the parameters gathered in between, no re-gather), else after every micro-batch."""
        settings = self.cfg.distributed
        if settings is None:
            return
        optimized = bool(backend_setting(self.cfg.model, "enable_fsdp_optimizations"))
        for unit in [module for module in self.model.modules() if isinstance(module, FSDPModule)]:  # every unit
            unit.set_requires_gradient_sync(last or not grad_sync_deferred(settings, self.cfg.model), recurse=False)
            if optimized:
                unit.set_reshard_after_backward(last, recurse=False)

    def _scaled_update(self, scaler: Any, grad_norm: torch.Tensor) -> None:
        """fp16: the scaler skips an update whose gradients overflowed and lowers its scale; such a step counts as
        skipped (``skipped_steps`` in training.jsonl) and ``fault_tolerance.max_skipped_steps`` bounds them."""
        scale = scaler.get_scale()
        scaler.step(self.optimizer)
        scaler.update()
        if torch.isfinite(grad_norm):
            return
        self.skipped_steps += 1
        step, limit = self.step_scheduler.step + 1, self.cfg.fault_tolerance.max_skipped_steps
        self.log(f"step {step}: fp16 gradients overflowed at loss scale {scale:g}: update skipped, scale now "
                 f"{scaler.get_scale():g} ({self.skipped_steps} skipped so far)")
        if limit is not None and self.skipped_steps > limit:
            raise AutomodelError(f"step {step}: {self.skipped_steps} updates skipped for fp16 gradient overflow, more "
                                 f"than fault_tolerance.max_skipped_steps ({limit}); lower optimizer.lr, set "
                                 "clip_grad_norm.max_norm, or train in bf16 (distributed.mp_policy.param_dtype)")

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
            name = type(self).__name__
            raise AutomodelError(
                f"the batch does not fit {name}.compute_loss / count_label_tokens: {type(err).__name__}: {err}. "
                f"The batch is {describe_batch(batch)}; it is what {loader_key}.collate_fn returns (the recipe's "
                "default when unset). Remove collate_fn, or make it return the keys and tensors the recipe reads; "
                "AUTOMODEL_DEBUG=1 shows the traceback") from err

    @torch.no_grad()
    def validate(self) -> None:
        """Every rank runs its share of each validation set (a forward under FSDP2 needs them all); the sums are
        reduced over the ranks and rank 0 reports."""
        self.model.eval()
        try:
            with naming_stalls(lambda: f"validation after step {self.step_scheduler.step}",
                               self.cfg.dist_env.timeout_minutes):
                for name, loader in self.val_dataloaders.items():
                    self._validate_one(name, loader)
        finally:
            self.model.train()

    def checkpoint_parts(self) -> CheckpointParts:
        """What a checkpoint of this moment holds (the state dicts are taken when it is written)."""
        steps, stateful = self.step_scheduler, self.stateful_attributes()
        trainer_state = {"format": TRAINER_STATE_FORMAT, "step": steps.step, "epoch": steps.epoch,
                         "losses": encode_losses(self.step_losses), "world_size": self.world_size,
                         "dp_size": self.ctx.mesh.dp,
                         "skipped_steps": self.skipped_steps, "step_scheduler": steps.state_dict()}
        return CheckpointParts(self.model, stateful.get("optimizer"), small_states(stateful), trainer_state,
                               self.save_artifacts, self.save_model if self.writes_own_layout() else None)

    def _validate_one(self, name: str, loader: Any) -> None:
        total = torch.zeros((), device=self.device)
        tokens = 0
        for batch in loader:
            with self.batch_errors(batch, "validation_dataloader"), \
                    validation_out_of_memory(name, self.step_scheduler.step, loader), \
                    self.loss_context(), self.forward_context():
                tokens += self.count_label_tokens(batch)
                total += self._validation_loss(batch)
        if self.ctx.mesh.dp > 1:
            total, summed = all_reduce_sum(total, tokens, device=self.device, group=self.data_parallel_group())
            tokens = type(tokens)(summed.item())
        record = {"step": self.step_scheduler.step, "epoch": self.step_scheduler.epoch, "name": name,
                  "val_loss": total.item() / (tokens if tokens > 0 else 1), "num_label_tokens": tokens}
        record.update(self.extra_validation_metrics(name, loader))
        record["timestamp"] = time.time()
        if self.is_main_process:
            self.val_log.write(record)
            self.metric_loggers.log_validation(record, record["step"])
        shown = ", ".join(f"{k}={v:.4f}" for k, v in record.items() if isinstance(v, float) and k != "timestamp")
        self.log(f"validation [{name}] step {record['step']}: {shown}")

    def save_checkpoint(self, last: bool = False) -> Path | None:
        """Every rank writes its own part; with ``checkpoint.async_save`` training goes on while the files are
        written and the checkpoint is published (``LATEST``) between two later steps. ``last``: the run's last
        checkpoint after its last step."""
        if not self.cfg.checkpoint.enabled:
            return None
        self.publish_checkpoint()  # one checkpoint in flight at a time
        self.checkpoint_in_flight = CheckpointWrite(self.checkpointer, self.checkpoint_parts(), self.rank,
                                                    self.device, self.cfg.checkpoint.async_save, last)
        if self.cfg.checkpoint.async_save:
            return self.checkpoint_in_flight.final
        return self.publish_checkpoint()

    def publish_checkpoint(self) -> Path | None:
        """Wait until the checkpoint in flight (if any) is written by every rank, then name it in LATEST."""
        write, self.checkpoint_in_flight = self.checkpoint_in_flight, None
        if write is None:
            return None
        path = write.finish()
        self.log(f"checkpoint: {path} (written in {write.seconds:.1f} s)")
        return path

    def _publish_when_written(self) -> None:
        """Between steps: publish an asynchronous checkpoint once every rank has written its part."""
        write = self.checkpoint_in_flight
        if write is not None and not any_rank(not write.done(), self.device):
            self.publish_checkpoint()

    def _sample(self, loss: float, grad_norm: torch.Tensor, tokens: int, elapsed: float) -> MetricsSample:
        tps = tokens / elapsed if elapsed > 0 else 0.0
        mfu = 6 * self.num_params * tps / self.peak_flops if self.peak_flops else None
        return MetricsSample(step=self.step_scheduler.step, epoch=self.step_scheduler.epoch, loss=loss,
                             grad_norm=float(grad_norm), lr=self.step_lr,
                             mem=peak_memory_gib(self.device), tps=tps, mfu=mfu)

    def _stop(self, stop: StopRequest, saved: bool) -> None:
        if not saved:
            self.final_checkpoint = self.save_checkpoint()
        self.publish_checkpoint()
        path = self.final_checkpoint
        name = {2: "SIGINT", 15: "SIGTERM"}.get(stop.signum, f"signal {stop.signum}")
        where = f"checkpoint: {path}; resume with --restore_from.path latest" if path else "no checkpoint (disabled)"
        raise TrainingStopped(stop.signum, f"stopped by {name} after step {self.step_scheduler.step}; {where}")

    def _already_complete(self) -> bool:
        """A rerun of a finished run: say so and train nothing (its weights stay as they are)."""
        steps, restored = self.step_scheduler, self.ctx.restore_path
        if restored is None or not steps.done:
            return False
        self.log(f"the run is complete: {restored} is at step {steps.step} ({steps.stop_reason()}); nothing to "
                 "train. Raise step_scheduler.max_steps (or num_epochs) to train on, or choose a new "
                 "checkpoint.checkpoint_dir to start over")
        return True

    def run_train_validation_loop(self) -> None:
        try:
            if not self._already_complete():
                self._train()
        finally:
            self.checkpointer.release()

    def _train(self) -> None:
        steps = self.step_scheduler
        settings = self.cfg.step_scheduler
        self.model.train()
        progress = Progress(steps.total_steps, steps.step, enabled=self.is_main_process)
        window_tokens, window_start = 0, time.perf_counter()
        window = settings.loss_average_window_steps
        recent_losses = deque(maxlen=window) if window else None  # loss_avg_window's steps
        saved_at = steps.step if self.ctx.restore_path is not None else None  # never re-save the restored step
        self.final_checkpoint: Path | None = None
        status = FAILED  # what the metric backends are told when the loop ends
        with StopRequest() as stop, PeriodicGarbageCollection(settings.gc_every_steps) as garbage:
            try:
                if self.is_main_process:  # records past the step this run starts from are redone: dropped now
                    self.train_log.open()
                    self.val_log.open()
                self.metric_loggers.open(self.cfg.raw)  # secrets are masked before any backend sees the config
                if settings.val_at_start and steps.step == 0 and self.val_dataloaders:
                    self.validate()  # the untouched model, recorded as step 0
                step_start = time.perf_counter()
                for batches in steps.batches(self.dataloader):
                    loss, grad_norm, tokens = self.train_step(batches)
                    step = steps.finish_step()
                    self.after_step(step, tokens, time.perf_counter() - step_start)
                    window_tokens += tokens
                    if recent_losses is not None:
                        recent_losses.append(loss.detach())
                    progress.update(1)
                    if steps.is_log_step() or steps.is_remote_log_step():
                        self._log_step(loss.item(), grad_norm, window_tokens, time.perf_counter() - window_start,
                                       progress, recent_losses)
                        window_tokens, window_start = 0, time.perf_counter()
                    if steps.is_val_step() and self.val_dataloaders:
                        self.validate()
                    self._publish_when_written()
                    last = step >= steps.total_steps
                    if steps.is_checkpoint_step(last=last):
                        saved_at = step
                        self.final_checkpoint = self.save_checkpoint(last=last)
                    garbage.after_step(step)
                    if any_rank(stop.requested, self.device) if self.world_size > 1 else stop.requested:
                        self._stop(stop, saved=saved_at == step)
                    step_start = time.perf_counter()
                self.log(f"training ended after step {steps.step}: {steps.stop_reason()}")
                if saved_at != steps.step and steps.step > 0:
                    self.final_checkpoint = self.save_checkpoint(last=True)
                self.publish_checkpoint()
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

    def _log_step(self, loss: float, grad_norm: torch.Tensor, tokens: int, elapsed: float, progress: Progress,
                  recent_losses: deque[torch.Tensor] | None) -> None:
        """One MetricsSample: to training.jsonl and the progress line (``log_interval``) and/or the backends
        (``log_remote_every_steps``)."""
        steps = self.step_scheduler
        to_file, to_backends = steps.is_log_step(), steps.is_remote_log_step()
        sample = self._sample(loss, grad_norm, tokens, elapsed)
        record = {**sample.to_dict(), **self.step_loss_parts}
        if self.cfg.fault_tolerance.nonfinite == "skip" or self.grad_scaler is not None:
            record["skipped_steps"] = self.skipped_steps
        if recent_losses is not None:
            record["loss_avg_window"] = torch.stack(list(recent_losses)).mean().item()
        if to_file:
            self.step_losses.append(loss)
        if self.is_main_process:
            if to_file:
                self.train_log.write(record)
            if to_backends:
                self.metric_loggers.log_train(record, record["step"])
        if to_file:
            progress.show(loss, sample.lr, sample.tps)
