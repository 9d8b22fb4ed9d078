"""The one training loop (DESIGN §9): steps, the token-weighted loss, validation, checkpoints, metrics, stops.

``TrainingLoop`` is a base of ``TrainRecipe``; it runs what ``setup`` built (``self.model``, ``self.optimizer``,
``self.dataloader``, ...) and calls the recipe's override points (``compute_loss``, ``count_label_tokens``,
``extra_validation_metrics``, ``after_step``, ``on_train_end``, ``save_model``). Domains never copy it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from automodel.errors import AutomodelError
from automodel.training.builders import describe_batch
from automodel.training.checkpoint import read_latest
from automodel.training.dist import all_reduce_sum, any_rank, barrier
from automodel.training.logging import FAILED, STOPPED, SUCCESS
from automodel.training.metrics import MetricsSample, peak_memory_gib
from automodel.training.signals import StopRequest, TrainingStopped
from automodel.training.state import full_model_state, gather_states


class TrainingLoop:
    """The loop and its events; the attributes it reads are built by ``TrainRecipe.setup``."""

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
        for index, batch in enumerate(batches):
            self.prepare_micro_batch(last=index == len(batches) - 1)
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

    def prepare_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch of a step (``last``: the step's final one); a recipe may, say, defer
        FSDP2's gradient reduction to the last one."""

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
        weights = full_model_state(self.model)
        states = gather_states(self.model, self.stateful_attributes())
        path = None
        if self.is_main_process:
            steps = self.step_scheduler
            trainer_state = {"step": steps.step, "epoch": steps.epoch, "losses": self.step_losses,
                             "world_size": self.world_size, "step_scheduler": steps.state_dict()}
            path = self.checkpointer.save(states, lambda d: self.save_model(d, weights), trainer_state,
                                          steps.epoch, steps.step)
            self.log(f"checkpoint: {path}")
        barrier()
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
