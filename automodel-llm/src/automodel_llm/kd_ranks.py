"""Which ranks train the student and which serve the teacher (upstream's ``separate_meshes: true``).

The world splits in two: the first ranks are the student's (``distributed.*`` lays them out, as in a run of their
own), the last ``teacher_distributed.dp_size`` ranks each hold a whole frozen copy of the teacher. Student rank ``s``
is served by teacher rank ``students + s % teachers``, so every teacher rank serves the same number of students, give
or take one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from automodel.errors import ConfigIssue
from automodel.training.dist import expected_world_size, planned_world_size, world_size_source
from automodel.training.parallel.mesh import LAYOUT_KEYS, smallest_world

# teacher_distributed keys that can only be 1 here, and why
_WHOLE_TEACHER = ("each teacher rank holds a whole copy of the teacher and runs its forward alone (the teacher's own "
                  "tensor, context, pipeline or expert parallelism is not implemented)")
_SINGLE_SIZES = ("tp_size", "cp_size", "pp_size", "ep_size", "dp_replicate_size")
TEACHER_KEYS = ("dp_size", "strategy", "sequence_parallel", *_SINGLE_SIZES)


@dataclass(frozen=True)
class RankSplit:
    """``students`` ranks first (0 .. students-1), then ``teachers`` ranks."""

    students: int
    teachers: int

    @property
    def world(self) -> int:
        return self.students + self.teachers

    def is_teacher(self, rank: int) -> bool:
        return rank >= self.students

    def teacher_of(self, student: int) -> int:
        return self.students + student % self.teachers

    def served_by(self, teacher: int) -> list[int]:
        """The student ranks teacher rank ``teacher`` serves."""
        return [s for s in range(self.students) if self.teacher_of(s) == teacher]

    def describe(self) -> str:
        return (f"separate_meshes: the student trains on {_ranks(0, self.students)}, the teacher runs on "
                f"{_ranks(self.students, self.world)} (a whole copy on each); student rank s gets its teacher logits "
                f"from rank {self.students} + s % {self.teachers}")


def _ranks(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}..{end - 1}"


def teacher_ranks(data: dict) -> int:
    """How many ranks the teacher gets: ``teacher_distributed.dp_size`` (1 without the section)."""
    section = data.get("teacher_distributed")
    size = section.get("dp_size", 1) if isinstance(section, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1


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
    return RankSplit(student_ranks(data, world), teacher_ranks(data))


def separate_world(data: dict) -> int:
    """The fewest ranks a ``separate_meshes: true`` config needs: the student's layout plus the teacher's ranks."""
    settings = data.get("distributed")
    sizes = {key: settings[key] for key in LAYOUT_KEYS if key in settings} if isinstance(settings, dict) else {}
    return smallest_world(**sizes) + teacher_ranks(data)


def teacher_section_issues(data: dict) -> list[ConfigIssue]:
    """What ``teacher_distributed`` asks that cannot act, each under its key."""
    section = data.get("teacher_distributed")
    if section is None:
        return []
    if data.get("separate_meshes") is not True:
        return [ConfigIssue("teacher_distributed", "lays out the teacher's own ranks, which it has only with "
                                                   "separate_meshes: true; set that, or remove the section")]
    if not isinstance(section, dict):
        return [ConfigIssue("teacher_distributed", f"expected a mapping of the teacher's layout, found {section!r}")]
    issues = []
    size = section.get("dp_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        issues.append(ConfigIssue("teacher_distributed.dp_size", f"the number of teacher ranks: expected an integer "
                                                                 f">= 1, found {size!r}"))
    for key in _SINGLE_SIZES:
        if section.get(key, 1) not in (1, None):
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"{section[key]!r}: {_WHOLE_TEACHER}; use 1 and "
                                      "give the teacher's ranks with teacher_distributed.dp_size"))
    if section.get("sequence_parallel") not in (False, None):
        issues.append(ConfigIssue("teacher_distributed.sequence_parallel", f"{_WHOLE_TEACHER}; set it to false"))
    strategy = section.get("strategy")
    if strategy not in (None, "ddp", "fsdp2"):
        issues.append(ConfigIssue("teacher_distributed.strategy", f"expected ddp or fsdp2, found {strategy!r}"))
    elif strategy == "fsdp2" and size != 1:
        issues.append(ConfigIssue("teacher_distributed.strategy", f"fsdp2 would shard the teacher over its {size} "
                                  "ranks, but each teacher rank holds a whole copy (serving its own students); use "
                                  "ddp, or dp_size: 1"))
    for key in section:
        if key not in TEACHER_KEYS:
            issues.append(ConfigIssue(f"teacher_distributed.{key}", f"not acted on: {_WHOLE_TEACHER}, so only "
                                      f"{', '.join(TEACHER_KEYS)} are read; remove it"))
    return issues


def split_issues(data: dict) -> list[ConfigIssue]:
    """A ``separate_meshes: true`` split that does not fill this run's world (or leaves a teacher rank idle)."""
    if data.get("separate_meshes") is not True:
        return []
    world, teachers = expected_world_size(), teacher_ranks(data)
    students = student_ranks(data, world)
    needed = separate_world(data)
    launch = f"launch with --nproc-per-node {needed}" if needed > 1 else "set distributed.dp_size"
    if students < 1 or students + teachers != world:
        return [ConfigIssue("teacher_distributed.dp_size", f"the student's {max(students, 0)} rank(s) "
                            f"(distributed.*) and the teacher's {teachers} rank(s) (teacher_distributed.dp_size) must "
                            f"add up to this run's {world} ({world_size_source()}); {launch}, or change the sizes")]
    if teachers > students:
        return [ConfigIssue("teacher_distributed.dp_size", f"{teachers} teacher ranks for {students} student "
                            f"rank(s): each teacher rank serves whole student ranks, so {teachers - students} would "
                            "serve none; use at most as many teacher ranks as student ranks")]
    return []

