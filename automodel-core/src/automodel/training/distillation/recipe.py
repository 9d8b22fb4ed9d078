"""Knowledge distillation: loss = (1 - kd_ratio) * CE + kd_ratio * KD, both over the label tokens."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from automodel.config import Free, Target
from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.model_kwargs import MTP_KEYS
from automodel.training.dist import chosen_backend, rank, world_size
from automodel.training.distillation.link import TeacherLink
from automodel.training.distillation.loss import KDLoss
from automodel.training.distillation.ranks import (
    TEACHER_KEYS,
    RankSplit,
    rank_split,
    separate_world,
    split_issues,
    student_world,
    teacher_section_issues,
)
from automodel.training.distillation.teacher import ContextParallelTeacher, PipelineTeacher, pp_teacher_issues
from automodel.training.loss import LINEAR, loss_fn_named
from automodel.training.parallel.pipeline_parallel import PipelineSettings
from automodel.training.parallel.tensor_parallel import apply_tensor_parallel, tp_issues
from automodel.training.parallelism import run_precision, shards_with_fsdp2


class KnowledgeDistillation:
    """Trains the student (``model``) towards a frozen ``teacher_model`` and the labels: mixed in before a recipe
    of :class:`~automodel.training.next_token.NextTokenLogits` (the LLM and VLM recipes), whose ``next_token_logits``
    gives both models' logits on the label positions.

    ``teacher_copy_unsupported``: ``teacher_distributed`` copy sizes (``cp_size`` / ``pp_size``) the recipe's teacher
    cannot be split by, with the reason (the context-parallel and pipeline teachers of ``teacher.py`` run text
    models)."""

    adds_mtp_loss = False  # compute_loss below combines the next-token and distillation losses only
    teacher_copy_unsupported: dict[str, str] = {}

    tensor_parallel_unsupported = ("the distillation loss compares the student's whole logits with the teacher's, "
                                   "which tensor parallelism keeps sharded over the vocabulary; use tp_size: 1")
    pipeline_parallel_unsupported = ("the teacher runs beside the student on whole batches, which pipeline stages "
                                     "split over ranks; use pp_size: 1")
    context_parallel_unsupported = ("the teacher runs beside the student on whole sequences, which context "
                                    "parallelism splits over ranks; use cp_size: 1")

    sections = {
        "teacher_model": Target("the frozen teacher: {_target_: ..., ...}", required=True),
        "kd_ratio": Free("weight of the KD term in [0, 1] (0: plain fine-tuning)"),
        "temperature": Free("softmax temperature of the KD term (default 1.0) when kd_loss_fn is not given; with "
                            "kd_loss_fn, its own temperature key (this one, if given, must agree)"),
        "kd_loss_fn": Target("the distillation loss (default automodel.training.distillation.loss.KDLoss)"),
        "offload_teacher_model": Free("true: the teacher's weights stay in host memory between its forwards and come "
                                      "to the device for each (saves device memory, costs a copy per micro-batch); "
                                      "false (the default). Not with separate_meshes: true"),
        "separate_meshes": Free("false (the default): a frozen teacher on every student rank; true: the teacher on "
                                "ranks of its own (the last teacher_distributed.dp_size x tp_size x cp_size x "
                                "pp_size ranks), which send their logits to the student's ranks"),
        "teacher_distributed": Free(f"the teacher's ranks with separate_meshes: true; keys {', '.join(TEACHER_KEYS)}:"
                                    " dp_size copies of the teacher, each tensor-parallel over tp_size, "
                                    "context-parallel over cp_size or a forward-only pipeline over pp_size ranks "
                                    "(pipeline: its settings), one of the three; strategy: fsdp2 with dp_size "
                                    "above 1 shards the weights of copies of one rank each over the teacher ranks"),
    }

    link: TeacherLink | None = None  # separate_meshes: true: this rank's end of the student-teacher link
    copy_group: dist.ProcessGroup | None = None  # a teacher rank of a copy over several ranks: the copy's ranks
    # a teacher rank of a context-parallel or pipeline copy: its part of the copy's forward (teacher.py)
    copy_forward: Callable[[dict[str, torch.Tensor]], torch.Tensor | None] | None = None

    @classmethod
    def own_world(cls, data: dict, nodes: int = 1) -> tuple[int, int]:
        """With separate_meshes: true the student's layout plus the teacher's ranks."""
        if data.get("separate_meshes") is True:
            return separate_world(data), nodes
        return super().own_world(data, nodes)

    @classmethod
    def describe_plan(cls, cfg: Any) -> list[str]:
        with student_world(cfg.resolved):
            return super().describe_plan(cfg)

    @classmethod
    def check_config(cls, cfg: Any) -> list[ConfigIssue]:
        with student_world(cfg.resolved):
            issues = super().check_config(cfg)
        ratio = cfg.resolved.get("kd_ratio", 0.5)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            issues.append(ConfigIssue("kd_ratio", f"expected a number in [0, 1], found {ratio!r}"))
        temperature = cfg.resolved.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
            issues.append(ConfigIssue("temperature", f"expected a number > 0, found {temperature!r}"))
        elif (loss := cfg.kd_loss_fn) is not None and "temperature" in cfg.resolved \
                and loss.get("temperature", 1.0) != temperature:
            issues.append(ConfigIssue("temperature", f"{temperature!r}, but kd_loss_fn builds its loss with "
                                      f"temperature {loss.get('temperature', 1.0)!r}: the top-level key sets the "
                                      "default loss's temperature only; set kd_loss_fn.temperature (upstream's place "
                                      "for it)"))
        separate = cfg.resolved.get("separate_meshes", False)
        if separate not in (True, False, None):
            issues.append(ConfigIssue("separate_meshes", f"expected true or false, found {separate!r}"))
        offload = cfg.resolved.get("offload_teacher_model", False)
        if offload not in (True, False, None):
            issues.append(ConfigIssue("offload_teacher_model", f"expected true or false, found {offload!r}"))
        elif offload and separate is True:
            issues.append(ConfigIssue("offload_teacher_model", "true with separate_meshes: true: the teacher then "
                                      "runs on ranks of its own, where keeping it off the device saves nothing for "
                                      "the student; set one of them to false"))
        issues += teacher_section_issues(cfg.resolved, cfg, cls.teacher_copy_unsupported) + split_issues(cfg.resolved)
        teacher = cfg.teacher_model
        for key in MTP_KEYS:
            if teacher is not None and teacher.get(key) not in (None, False, 0):
                issues.append(ConfigIssue(f"teacher_model.{key}", "MTP heads train with the student; the frozen "
                                          "teacher only serves its next-token logits, so its heads would never run: "
                                          "remove it"))
        if loss_fn_named(cfg, LINEAR) is not None:
            issues.append(ConfigIssue("loss_fn._target_", "FusedLinearCrossEntropy computes the loss inside the "
                                      "student's output head, so no logits are left for the distillation loss; use "
                                      "MaskedCrossEntropy or ChunkedCrossEntropy"))
        return issues

    def setup(self) -> None:
        self.kd_ratio = float(self.cfg.resolved.get("kd_ratio", 0.5))
        self.offload_teacher = self.cfg.resolved.get("offload_teacher_model") is True
        split = rank_split(self.cfg.resolved, world_size())
        if split is not None:
            env = self.cfg.dist_env
            self.link = TeacherLink(split, rank(), env.timeout_minutes, env.init_method)
            if split.is_teacher(rank()):
                # this rank builds no data set: the training section's class says how its labels pair
                self.labels_shifted = self.labels_shifted_in_config(self.cfg)
                self.label_offset = 0 if self.labels_shifted else 1
                self.teacher = self.build_teacher(self.select_device())
                self.copy_group = self.shard_teacher(split) if split.copy_size > 1 else None
                if split.sharded:
                    self.shard_teacher_over_copies(split)
                return
            os.environ["WORLD_SIZE"] = str(split.students)  # the student's run is a run on its ranks only
        super().setup()
        if split is None:
            self.teacher = self.build_teacher(self.device)
        node = self.cfg.kd_loss_fn
        temperature = float(self.cfg.resolved.get("temperature", 1.0))
        self.kd_loss_fn = node.instantiate() if node is not None else KDLoss(temperature)
        self.log(f"distilling from {self.cfg.teacher_model.target} (frozen) with kd_ratio={self.kd_ratio}")
        where = " in host memory between its forwards (offload_teacher_model)" if self.offload_teacher else ""
        self.log(split.describe() if split is not None else "the teacher is a frozen copy on every rank of the "
                 f"student (separate_meshes: false){where}")

    @classmethod
    def labels_shifted_in_config(cls, cfg: Any) -> bool:
        """Whether the training data set's labels are the next tokens already, read from the config alone (a
        teacher rank builds no data set); a recipe whose data sets can say so overrides this."""
        return False

    def process_group_store(self) -> Any:
        return self.link.student_store() if self.link is not None else None

    def build_teacher(self, device: torch.device) -> torch.nn.Module:
        """The frozen teacher on ``device`` (in host memory with ``offload_teacher_model: true``), with its output
        head on the label positions where the student's is. Built from the run's seed, whatever the random state
        here: a teacher with fresh weights (``from_config``) is then the same on every rank, in a resumed run (whose
        random state is the checkpoint's by now) and on ranks of its own."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.rng.seed)
            teacher = self.cfg.teacher_model.instantiate()
        teacher.to("cpu" if self.offload_teacher else device).eval()
        teacher.requires_grad_(False)
        self.teacher_head = self.attach_head(teacher) if self.cfg.logits.label_positions_only else None
        return teacher

    def shard_teacher(self, split: RankSplit) -> dist.ProcessGroup:
        """(teacher rank) Split the teacher over its copy's ranks (a ``dp x tp``, ``dp x cp`` or ``dp x pp`` mesh
        of the teacher ranks): tensor-parallel by the core's plan, or context-parallel, or cut into pipeline stages
        (``teacher.py``); the copy's group, whose ranks run each forward together."""
        name, size = next((name, size) for name, size in (("tp", split.tp), ("cp", split.cp), ("pp", split.pp))
                          if size > 1)
        mesh, device = self.teacher_mesh((split.teachers, size), ("dp", name))
        mesh = mesh[name]
        section = self.cfg.resolved["teacher_distributed"]
        config = getattr(self.teacher, "config", None)
        if name == "pp":
            settings = PipelineSettings.from_section(section.get("pipeline"))
            found = pp_teacher_issues(config, size, section.get("pipeline"), self.cfg) if config is not None else []
            if found:
                raise ConfigError(found)
            self.copy_forward = PipelineTeacher(self.teacher, mesh, device, settings)
            self.teacher = None  # this rank keeps its stage only
        elif name == "cp":
            self.copy_forward = ContextParallelTeacher(self.teacher, mesh, section.get("strategy") == "fsdp2")
        else:
            found = tp_issues(config, size, section="teacher_distributed") if config is not None else []
            if found:
                raise ConfigError(found)
            apply_tensor_parallel(self.teacher, mesh, vocab_parallel=False)  # the head returns whole logits
        if self.copy_forward is not None:
            self.copy_forward.label_offset = self.label_offset
        return mesh.get_group()

    def shard_teacher_over_copies(self, split: RankSplit) -> None:
        """(teacher rank, ``teacher_distributed.strategy: fsdp2`` with ``dp_size`` above 1) Shard the teacher's
        weights over the teacher ranks with FSDP2, as upstream shards a teacher over its data-parallel ranks: each rank
        keeps ``1 / dp_size`` of them, and every forward gathers them on all the ranks together, each forward on its
        own students' micro-batch. The copies serve as many student ranks each (validated), and every student rank
        runs as many micro-batches (synchronous data-parallel training and validation), so the ranks' forwards pair
        up."""
        from automodel.training.parallel.fsdp import apply_fsdp2

        apply_fsdp2(self.teacher, self.teacher_mesh((split.teachers,), ("dp",))[0])

    def teacher_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[Any, torch.device]:
        """(teacher rank) Join the other teacher ranks in torch's default group and lay a device mesh of ``shape``
        over them; the mesh and this rank's device."""
        from torch.distributed.device_mesh import init_device_mesh

        device, env = self.select_device(), self.cfg.dist_env
        self.link.join_teachers(chosen_backend(env.backend, self.log), env.timeout_minutes, device)
        return init_device_mesh(device.type, shape, mesh_dim_names=names), device

    def run_train_validation_loop(self) -> None:
        """A teacher rank serves its students until each has stopped; a student rank trains, then stops its teacher
        rank (also when its training failed, so that the teacher rank does not wait out the timeout)."""
        if self.link is None:
            super().run_train_validation_loop()
            return
        try:
            if self.link.split.is_teacher(rank()):
                self.serve_teacher_logits()
                return
            try:
                super().run_train_validation_loop()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the teacher rank may be what failed: keep the first error
                    self.link.stop()
                raise
            self.link.stop()
        finally:
            self.link.close()

    def serve_teacher_logits(self) -> None:
        """(teacher rank) The teacher's logits of each micro-batch its students send, computed as a student rank
        computes them with the teacher beside it: the same forward, precision and output head."""
        cfg, device = self.cfg, self.select_device()
        students = self.link.split.students
        fsdp2 = shards_with_fsdp2(cfg, self.pipeline_selection(cfg).get("sharding", (None, ""))[0], students)
        precision = run_precision(cfg, device, fsdp2)[0]

        @torch.no_grad()
        def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
            with precision.forward_context(device.type, fsdp2):
                if self.copy_forward is not None:
                    return self.copy_forward(batch)
                return self.next_token_logits(self.teacher, batch, self.teacher_head)[0]

        self.link.serve(forward, device, self.copy_group)

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, targets = self.next_token_logits(model, batch, self.head_positions)
        ce = self.loss_fn(logits, targets)
        if self.kd_ratio == 0:
            return ce
        if self.link is not None:
            teacher_logits = self.link.teacher_logits(batch)
        else:
            with torch.no_grad(), offloaded(self.teacher, self.device, self.offload_teacher):
                teacher_logits, _ = self.next_token_logits(self.teacher, batch, self.teacher_head)
        if teacher_logits.shape[-1] != logits.shape[-1]:
            raise AutomodelError(f"teacher_model: its logits cover {teacher_logits.shape[-1]} tokens, the student's "
                                 f"{logits.shape[-1]}; distillation compares them token by token, so the teacher "
                                 "must share the student's tokenizer and vocabulary")
        kd = self.kd_loss_fn(logits, teacher_logits, targets)
        if model.training:  # logged beside the loss as loss_ce and loss_kd (per label token, as the loss)
            self.add_loss_part("ce", ce)
            self.add_loss_part("kd", kd)
        return (1 - self.kd_ratio) * ce + self.kd_ratio * kd


@contextlib.contextmanager
def offloaded(teacher: torch.nn.Module, device: torch.device, offload: bool) -> Iterator[None]:
    """``offload_teacher_model: true``: the teacher's weights live in host memory and come to ``device`` for each
    forward only (upstream's key; it saves the device memory of the teacher between its forwards)."""
    if not offload:
        yield
        return
    teacher.to(device)
    try:
        yield
    finally:
        teacher.to("cpu")
