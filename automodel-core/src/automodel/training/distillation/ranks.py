"""Which ranks train the student and which serve the teacher (upstream's ``separate_meshes: true``).

The world splits in two: the first ranks are the student's (``distributed.*`` lays them out, as in a run of their
own), the last ``teacher_distributed.dp_size x tp_size x cp_size x pp_size`` ranks serve the teacher: ``dp_size``
copies of it, each over a group of consecutive ranks that is tensor-parallel (``tp_size``), context-parallel
(``cp_size``) or a pipeline (``pp_size``), one of the three. Student rank ``s`` is served by copy ``s % dp_size``,
whose leader receives the student's micro-batches and sends the logits back: the copy's first rank, or with a
pipeline its last (the rank of the last stage, which computes the logits); so every copy serves the same number of
students, give or take one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from automodel.errors import ConfigIssue
from automodel.training.dist import expected_world_size, planned_world_size, world_size_source
from automodel.training.distillation.teacher import cp_teacher_issues, pp_teacher_issues
from automodel.training.parallel.mesh import LAYOUT_KEYS, smallest_world
from automodel.training.parallel.tensor_parallel import tp_issues
from automodel.training.parallelism import model_hf_config

# teacher_distributed keys that can only be 1 here, and why
_NOT_IMPLEMENTED = {
    "ep_size": "the teacher's expert parallelism is not implemented: each teacher copy holds every expert (split "
               "them over ranks with teacher_distributed.tp_size instead)",
    "dp_replicate_size": "the teacher's copies are teacher_distributed.dp_size; it has no replicate dimension",
}
COPY_SIZES = ("tp_size", "cp_size", "pp_size")  # how one copy spreads over its ranks: one of them above 1
TEACHER_KEYS = ("dp_size", *COPY_SIZES, "strategy", "sequence_parallel", "pipeline", *_NOT_IMPLEMENTED)


@dataclass(frozen=True)
class RankSplit:
    """``students`` ranks first (0 .. students-1), then ``teachers`` copies of the teacher of ``tp x cp x pp``
    ranks each (one of the three above 1). ``sharded``: copies of one rank each whose weights FSDP2 shards over all
    of them (``teacher_distributed.strategy: fsdp2`` with ``dp_size`` above 1): every forward runs on all of them
    together, each on its own students' micro-batch."""

    students: int
    teachers: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    sharded: bool = False

    @property
    def copy_size(self) -> int:
        """The ranks of one teacher copy."""
        return self.tp * self.cp * self.pp

    @property
    def leader_index(self) -> int:
        """The leader's place within its copy: the last rank with a pipeline (its last stage), else the first."""
        return self.pp - 1

    @property
    def world(self) -> int:
        return self.students + self.teachers * self.copy_size

    def is_teacher(self, rank: int) -> bool:
        return rank >= self.students

    def teacher_of(self, student: int) -> int:
        """The leader of the teacher copy that serves student rank ``student``."""
        return self.students + (student % self.teachers) * self.copy_size + self.leader_index

    def leader_of(self, teacher: int) -> int:
        """The leader of teacher rank ``teacher``'s copy: the one its students talk to."""
        return teacher - (teacher - self.students) % self.copy_size + self.leader_index

    def served_by(self, teacher: int) -> list[int]:
        """The student ranks teacher rank ``teacher``'s copy serves."""
        leader = self.leader_of(teacher)
        return [s for s in range(self.students) if self.teacher_of(s) == leader]

    def describe(self) -> str:
        size = self.copy_size
        how = "tensor-parallel over" if self.tp > 1 else "context-parallel over" if self.cp > 1 else "a pipeline over"
        copies = ("a whole copy on each" if size == 1 else
                  f"{self.teachers} cop{'y' if self.teachers == 1 else 'ies'}, each {how} {size} consecutive ranks")
        if self.sharded:
            copies = f"{self.teachers} copies, their weights sharded over the {self.teachers} ranks by FSDP2"
        leader = f"s % {self.teachers}" if size == 1 else f"(s % {self.teachers}) * {size}"
        leader += f" + {self.leader_index} (the last stage)" if self.leader_index else ""
        return (f"separate_meshes: the student trains on {_ranks(0, self.students)}, the teacher runs on "
                f"{_ranks(self.students, self.world)} ({copies}); student rank s gets its teacher logits "
                f"from rank {self.students} + {leader}")


def _ranks(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}..{end - 1}"


def _size(data: dict, key: str) -> int:
    """``teacher_distributed.<key>`` (1 without the section, or when it is not a size: validation says so)."""
    section = data.get("teacher_distributed")
    size = section.get(key, 1) if isinstance(section, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1


def teacher_ranks(data: dict) -> int:
    """How many ranks the teacher gets: ``teacher_distributed.dp_size x tp_size x cp_size x pp_size`` (1 without
    the section)."""
    return _size(data, "dp_size") * _size(data, "tp_size") * _size(data, "cp_size") * _size(data, "pp_size")


def student_ranks(data: dict, world: int) -> int:
    """The student's ranks: what ``distributed.*`` fixes (``dp_size`` given), else every rank the teacher leaves."""
    settings = data.get("distributed")
    sizes = {key: settings[key] for key in LAYOUT_KEYS if key in settings} if isinstance(settings, dict) else {}
    if sizes.get("dp_size") in ("auto", "none", None):
        return world - teacher_ranks(data)
    return smallest_world(**sizes)


@contextlib.contextmanager
def student_world(data: dict) -> Iterator[None]:
    """Within the block, validation and the plan see the student's ranks only (with separate_meshes: true), as
    the student's run does: its layout is that of a run of its own."""
    split = rank_split(data, expected_world_size())
    if split is None or split.students < 1:
        yield
        return
    with planned_world_size(split.students, f"the student's ranks: {split.describe()}"):
        yield


def rank_split(data: dict, world: int) -> RankSplit | None:
    """The split of ``world`` ranks (a resolved config ``data``), or None when the teacher shares the student's."""
    if data.get("separate_meshes") is not True:
        return None
    section = data.get("teacher_distributed")
    strategy = section.get("strategy") if isinstance(section, dict) else None
    sharded = strategy == "fsdp2" and _size(data, "dp_size") > 1 and not any(_size(data, k) > 1 for k in COPY_SIZES)
    return RankSplit(student_ranks(data, world), _size(data, "dp_size"), _size(data, "tp_size"),
                     _size(data, "cp_size"), _size(data, "pp_size"), sharded)


def separate_world(data: dict) -> int:
    """The fewest ranks a ``separate_meshes: true`` config needs: the student's layout plus the teacher's ranks."""
    settings = data.get("distributed")
    sizes = {key: settings[key] for key in LAYOUT_KEYS if key in settings} if isinstance(settings, dict) else {}
    return smallest_world(**sizes) + teacher_ranks(data)


def teacher_section_issues(data: dict, cfg: Any, unsupported: dict[str, str] | None = None) -> list[ConfigIssue]:
    """What ``teacher_distributed`` asks that cannot act, each under its key (``cfg``: the config, whose
    ``teacher_model`` must be able to split as the sizes ask; ``unsupported``: copy sizes (``cp_size``, ...) the
    recipe cannot split its teacher by, with the reason)."""
    section = data.get("teacher_distributed")
    if section is None:
        return []
    if data.get("separate_meshes") is not True:
        return [ConfigIssue("teacher_distributed", "lays out the teacher's own ranks, which it has only with "
                                                   "separate_meshes: true; set that, or remove the section")]
    if not isinstance(section, dict):
        return [ConfigIssue("teacher_distributed", f"expected a mapping of the teacher's layout, found {section!r}")]
    issues = []
    for key, what in (("dp_size", "the number of teacher copies"), ("tp_size", "the ranks of each teacher copy"),
                      ("cp_size", "the ranks of each teacher copy"), ("pp_size", "the ranks of each teacher copy")):
        size = section.get(key, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"{what}: expected an integer >= 1, found "
                                                                    f"{size!r}"))
    split = [key for key in COPY_SIZES if _size(data, key) > 1]
    if len(split) > 1:
        issues.append(ConfigIssue(f"teacher_distributed.{split[1]}", f"{section[split[1]]!r} with {split[0]} "
                                  f"{section[split[0]]!r}: a teacher copy here is split one way only (tensor, context "
                                  "or pipeline parallel), not a mesh of several; set all but one of "
                                  f"{', '.join(split)} to 1"))
    for key, reason in _NOT_IMPLEMENTED.items():
        if section.get(key, 1) not in (1, None):
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"{section[key]!r}: {reason}; use 1"))
    if section.get("sequence_parallel") not in (False, None):
        issues.append(ConfigIssue("teacher_distributed.sequence_parallel", "the teacher's sequence parallelism is "
                                  "not implemented (its tensor parallelism gives each rank whole sequences); set it "
                                  "to false"))
    size, strategy = section.get("dp_size", 1), section.get("strategy")
    if strategy not in (None, "ddp", "fsdp2"):
        issues.append(ConfigIssue("teacher_distributed.strategy", f"expected ddp or fsdp2, found {strategy!r}"))
    elif strategy == "fsdp2" and size != 1 and (split := [key for key in COPY_SIZES if _size(data, key) > 1]):
        issues.append(ConfigIssue("teacher_distributed.strategy", f"fsdp2 with dp_size {size} shards the teacher's "
                                  f"weights over its copies, but each copy here is also split by {split[0]}: a "
                                  "teacher is sharded over its copies or split within one, not both; use ddp, or "
                                  "copies of one rank each"))
    for key, reason in (unsupported or {}).items():
        if _size(data, key) > 1:
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"{section[key]!r}: {reason}; use 1"))
    for key in section:
        if key not in TEACHER_KEYS:
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"not acted on: only {', '.join(TEACHER_KEYS)} "
                                      "lay out the teacher's ranks; remove it"))
    if issues:
        return issues
    return issues + _copy_issues(data, cfg)


def _copy_issues(data: dict, cfg: Any) -> list[ConfigIssue]:
    """Whether the teacher (its config, where readable) splits as ``tp_size``, ``cp_size`` or ``pp_size`` ask."""
    section = data["teacher_distributed"]
    tp, cp, pp = _size(data, "tp_size"), _size(data, "cp_size"), _size(data, "pp_size")
    if section.get("pipeline") is not None and pp == 1:
        return [ConfigIssue("teacher_distributed.pipeline", "lays out the teacher's pipeline, which it has only with "
                            "teacher_distributed.pp_size above 1; set that, or remove the section")]
    hf_config = model_hf_config(cfg, "teacher_model") if tp * cp * pp > 1 else None
    if pp > 1:
        return pp_teacher_issues(hf_config, pp, section.get("pipeline"), cfg)
    if cp > 1:
        return cp_teacher_issues(cfg, cp, hf_config)
    return tp_issues(hf_config, tp, section="teacher_distributed") if hf_config is not None else []


def split_issues(data: dict) -> list[ConfigIssue]:
    """A ``separate_meshes: true`` split that does not fill this run's world (or leaves a teacher copy idle)."""
    if data.get("separate_meshes") is not True:
        return []
    world, ranks, copies = expected_world_size(), teacher_ranks(data), _size(data, "dp_size")
    students = student_ranks(data, world)
    needed = separate_world(data)
    launch = f"launch with --nproc-per-node {needed}" if needed > 1 else "set distributed.dp_size"
    if students < 1 or students + ranks != world:
        return [ConfigIssue("teacher_distributed.dp_size", f"the student's {max(students, 0)} rank(s) "
                            f"(distributed.*) and the teacher's {ranks} rank(s) (teacher_distributed.dp_size x "
                            f"tp_size x cp_size x pp_size) must add up to this run's {world} ({world_size_source()}); "
                            f"{launch}, or change the sizes")]
    if copies > students:
        return [ConfigIssue("teacher_distributed.dp_size", f"{copies} teacher copies for {students} student "
                            f"rank(s): each copy serves whole student ranks, so {copies - students} would serve none; "
                            "use at most as many teacher copies as student ranks")]
    if rank_split(data, world).sharded and students % copies:
        return [ConfigIssue("teacher_distributed.strategy", f"fsdp2 runs each forward on all {copies} teacher "
                            f"copies together, so each must serve as many student ranks, but {students} student ranks "
                            f"do not split evenly over {copies}; use ddp, or a dp_size that divides {students}")]
    return []
