"""Knowledge distillation with the teacher on ranks of its own (``separate_meshes: true``), on CPU ranks (gloo).

The student ranks send each micro-batch to their teacher rank and get its logits back, so a run's losses and
weights equal those of the run with the teacher beside the student on the same student ranks: 1 student + 1
teacher rank against one process, 2 students + 1 teacher rank against two ranks, 1 student + a teacher
tensor-parallel over 2 ranks against one process (each colocated run once). One run of each layout serves
every test of it (multi-rank runs are the slow part of the suite). The separate-mesh runs go through a KD recipe of
this test's own (a plugin distribution) that lists each rank's native threads at exit: the link's gloo threads must
be gone before interpreter shutdown, on the teacher rank too (see automodel-core's test_clean_exit.py).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from llm_testing import VALIDATION, assert_same_weights, losses, val_losses, write_config

from automodel.errors import ConfigError
from automodel.testing import load_config, run_cli, write_dist, write_yaml
from automodel.training.dist import planned_world_size

ORDERED = ["--step_scheduler.max_steps", "4", "--dataloader.batch_size", "2", "--dataloader.shuffle", "false",
           "--step_scheduler.val_check_interval", "2"]


THREAD_REPORTING_KD = '''
import atexit
import contextlib
import os
from pathlib import Path

from automodel_llm.kd import KnowledgeDistillationRecipe


def record_threads(path):
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            names.append((task / "comm").read_text().strip())
    path.write_text("\\n".join(names))


class ThreadReportingKD(KnowledgeDistillationRecipe):
    """The KD run; at exit, the names of this rank's native threads go to threads-<rank>.txt."""

    def setup(self):
        atexit.register(record_threads, Path(f"threads-{os.environ['RANK']}.txt").resolve())
        super().setup()
'''

PLUGIN = '''
from automodel import hookimpl


@hookimpl
def automodel_allowed_targets():
    return ["kd_exit_probe"]
'''


@pytest.fixture(scope="module")
def kd_config(tmp_path_factory, tiny_llama_config):
    """The tiny student, distilled from a 2-layer teacher (a pipeline cuts it in two) whose output head is tied to
    its input embedding (the first stage holds the one, the last the other)."""
    tmp = tmp_path_factory.mktemp("kd")
    teacher_config = tmp / "teacher.json"
    data = {**json.loads(tiny_llama_config.read_text()), "num_hidden_layers": 2}
    assert data["tie_word_embeddings"] is True
    teacher_config.write_text(json.dumps(data))
    teacher = {"_target_": "automodel_llm.AutoModelForCausalLM.from_config", "config": str(teacher_config),
               "seed": 7}
    return write_config(tmp / "kd.yaml", tiny_llama_config, tmp / "ckpt", teacher_model=teacher, kd_ratio=0.5,
                        temperature=2.0, validation_dataset=VALIDATION)


def _kd_run(command, config, directory, *args, **env) -> str:
    """``automodel <command> -c config`` into ``directory`` (several processes: a free rendezvous port); its log."""
    from automodel.testing import free_port

    port = ["--master-port", str(free_port())] if "--nproc-per-node" in args else []
    result = run_cli(*command, "-c", config, *ORDERED, *args, *port, "--checkpoint.checkpoint_dir", directory,
                     cwd=directory.parent, OMP_NUM_THREADS="1", **env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def _thread_reporting(config, tmp):
    """``config`` run by the thread-reporting KD recipe, and the PYTHONPATH that finds its distribution."""
    dist = write_dist(tmp / "dist", "kd-exit-probe", "0.1", {"kd_exit_probe": "kd_exit_probe.plugin"},
                      {"kd_exit_probe/__init__.py": "", "kd_exit_probe/recipe.py": THREAD_REPORTING_KD,
                       "kd_exit_probe/plugin.py": PLUGIN})
    data = yaml.safe_load(config.read_text())
    data["recipe"] = {"_target_": "kd_exit_probe.recipe.ThreadReportingKD"}
    pythonpath = os.pathsep.join(filter(None, [str(dist), os.environ.get("PYTHONPATH")]))
    return write_yaml(tmp / "probe.yaml", data), pythonpath


@pytest.fixture(scope="module")
def colocated_runs(kd_config, tmp_path_factory):
    """``run(students)``: the directory of the colocated run on ``students`` ranks (each run once per module)."""
    runs = {}

    def run(students: int):
        if students not in runs:
            tmp = tmp_path_factory.mktemp(f"colocated{students}")
            ranks = ["--nproc-per-node", str(students)] if students > 1 else []
            _kd_run(("kd", "llm"), kd_config, tmp / "colocated", *ranks)
            runs[students] = tmp / "colocated"
        return runs[students]

    return run


# a copy of the teacher over 2 ranks: its teacher_distributed keys, and how the run's plan says it
COPIES = {
    "tp": (["--teacher_distributed.tp_size", "2"], "tensor-parallel over"),
    # fsdp2: the copy's weights sharded over its 2 context-parallel ranks; eager attention: run as SDPA in the region
    "cp": (["--teacher_distributed.cp_size", "2", "--teacher_distributed.strategy", "fsdp2",
            "--teacher_model.attn_implementation", "eager"], "context-parallel over"),
    "pp": (["--teacher_distributed.pp_size", "2", "--teacher_distributed.pipeline.pp_schedule", "1f1b",
            "--teacher_distributed.pipeline.pp_microbatch_size", "1",
            "--teacher_distributed.pipeline.scale_grads_in_schedule", "false"], "a pipeline over"),
}


# two copies of one rank each, their weights sharded over both by FSDP2 (upstream's teacher_dp2 form)
SHARDED = (["--teacher_distributed.dp_size", "2", "--teacher_distributed.strategy", "fsdp2"],
           "2 copies, their weights sharded over the 2 ranks by FSDP2")


# make test-slow: two students and a teacher split over its two ranks (sharded copies, tp, cp, pp); the default run
# takes one student and one teacher rank through the same link
@pytest.fixture(scope="module", params=[(1, None), *(pytest.param(p, marks=pytest.mark.slow) for p in
                                                     [(2, "fsdp2"), (2, None), (1, "tp"), (1, "cp"), (1, "pp")])],
                ids=["1_student", "2_students_2_sharded_copies", "2_students", "1_student_tp2", "1_student_cp2",
                     "1_student_pp2"])
def layout(request, kd_config, colocated_runs, tmp_path_factory):
    """(colocated run, separate-mesh run, its log, its teacher ranks, how the teacher is laid out) for
    ``request.param`` = (student ranks, the teacher's 2 ranks: one copy split by tp, cp or pp, or two copies sharded
    by fsdp2; None: one copy on one rank)."""
    students, split = request.param
    keys, how = (SHARDED if split == "fsdp2" else COPIES[split]) if split else ([], None)
    tmp = tmp_path_factory.mktemp(f"students{students}_{split}")
    probe, pythonpath = _thread_reporting(kd_config, tmp)
    ranks = 2 if split else 1
    log = _kd_run(("run",), probe, tmp / "separate", "--nproc-per-node", str(students + ranks), "--separate_meshes",
                  "true", "--distributed.dp_size", str(students), "--teacher_distributed.dp_size", "1", *keys,
                  PYTHONPATH=pythonpath)
    return colocated_runs(students), tmp / "separate", log, range(students, students + ranks), how


def test_the_teacher_on_its_own_ranks_gives_the_colocated_runs_losses_and_weights(layout):
    """Also with the teacher's logits computed by a copy over 2 ranks (tensor- or context-parallel, or a pipeline of
    2 stages): a part missing or out of place would change the KD loss."""
    colocated, separate, log, teachers, how = layout
    copy = ("a whole copy on each" if how is None else how if how == SHARDED[1] else
            f"1 copy, each {how} {len(teachers)} consecutive ranks")
    where = f"rank {teachers[0]}" if len(teachers) == 1 else f"ranks {teachers[0]}..{teachers[-1]}"
    assert f"the teacher runs on {where} ({copy})" in log
    assert losses(separate) == pytest.approx(losses(colocated), rel=1e-5)
    assert [v for _, v in val_losses(separate)] == pytest.approx([v for _, v in val_losses(colocated)], rel=1e-5)
    assert_same_weights(separate / "epoch_0_step_4" / "model", colocated / "epoch_0_step_4" / "model")
    # the teacher ranks write nothing: the checkpoints hold the same files as the colocated run's
    files = sorted(p.relative_to(separate).as_posix() for p in separate.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(colocated).as_posix() for p in colocated.rglob("*") if p.is_file())


def test_no_rank_leaves_a_gloo_thread_to_interpreter_shutdown(layout):
    _, separate, _, teachers, how = layout
    if how is not None and how != "a pipeline over":  # tensor / context parallel, FSDP2: DTensors
        pytest.skip("known gap: once a DTensor is built, torch (2.13) holds the teacher ranks' default gloo group on "
                    "its C++ side past destroy_process_group (no Python object refers to it), so that group's "
                    "threads are alive at the rank's exit (which skips interpreter finalization: exit_rank)")
    reports = sorted(separate.parent.glob("threads-*.txt"))
    assert [report.name for report in reports] == [f"threads-{rank}.txt" for rank in range(teachers[-1] + 1)]
    for report in reports:
        threads = report.read_text().split()
        assert threads and not [name for name in threads if "gloo" in name], (report.name, threads)


def _issues(config, world, *overrides) -> dict[str, str]:
    with planned_world_size(world, f"--nproc-per-node {world}"), pytest.raises(ConfigError) as info:
        load_config(config, *overrides, route=("kd", "llm"))
    return {issue.key: issue.message for issue in info.value.issues}


def test_sizes_that_do_not_fill_the_world_name_the_keys_and_the_launch(kd_config):
    found = _issues(kd_config, 4, "--separate_meshes", "true", "--distributed.dp_size", "1")
    message = found["teacher_distributed.dp_size"]
    assert "the student's 1 rank(s) (distributed.*) and the teacher's 1 rank(s)" in message
    assert "this run's 4" in message and "launch with --nproc-per-node 2" in message
    found = _issues(kd_config, 3, "--separate_meshes", "true", "--teacher_distributed.dp_size", "2")
    assert "1 would serve none" in found["teacher_distributed.dp_size"]


def test_teacher_layout_keys_that_cannot_act_are_refused_with_the_reason(kd_config):
    separate = ["--separate_meshes", "true", "--distributed.dp_size", "1"]
    found = _issues(kd_config, 4, "--separate_meshes", "true", "--distributed.dp_size", "2",
                    "--teacher_distributed.dp_size", "2", "--teacher_distributed.ep_size", "2")
    assert "the teacher's expert parallelism is not implemented" in found["teacher_distributed.ep_size"]
    found = _issues(kd_config, 6, "--separate_meshes", "true", "--distributed.dp_size", "2",
                    "--teacher_distributed.dp_size", "2", "--teacher_distributed.tp_size", "2",
                    "--teacher_distributed.strategy", "fsdp2")
    assert "sharded over its copies or split within one, not both" in found["teacher_distributed.strategy"]
    found = _issues(kd_config, 5, "--separate_meshes", "true", "--distributed.dp_size", "3",
                    "--teacher_distributed.dp_size", "2", "--teacher_distributed.strategy", "fsdp2")
    assert "3 student ranks do not split evenly over 2" in found["teacher_distributed.strategy"]
    found = _issues(kd_config, 5, *separate, "--teacher_distributed.cp_size", "2",
                    "--teacher_distributed.pp_size", "2")
    assert "split one way only" in found["teacher_distributed.pp_size"]
    found = _issues(kd_config, 2, *separate, "--teacher_distributed.pipeline.pp_schedule", "1f1b")
    assert "only with teacher_distributed.pp_size above 1" in found["teacher_distributed.pipeline"]
    pipeline = [*separate, "--teacher_distributed.pp_size", "2", "--teacher_distributed.pipeline.pp_schedule"]
    found = _issues(kd_config, 3, *pipeline, "interleaved1f1b", "--teacher_distributed.pipeline.pp_seq_len", "64",
                    "--teacher_distributed.pipeline.scale_grads_in_schedule", "true")
    assert "finds each batch's shapes with its forward" in found["teacher_distributed.pipeline.pp_seq_len"]
    assert "set it to False" in found["teacher_distributed.pipeline.scale_grads_in_schedule"]
    found = _issues(kd_config, 3, *pipeline, "interleaved1f1b")
    assert "use gpipe or 1f1b" in found["teacher_distributed.pipeline.pp_schedule"]
    found = _issues(kd_config, 3, *pipeline, "1f1b", "--teacher_distributed.pipeline.pp_microbatch_size", "3")
    assert "3 does not divide the 4 rows" in found["teacher_distributed.pipeline.pp_microbatch_size"]
    found = _issues(kd_config, 4, *separate, "--teacher_distributed.pp_size", "3")
    assert "each stage needs a layer" in found["teacher_distributed.pp_size"]
    found = _issues(kd_config, 3, *separate, "--teacher_distributed.cp_size", "2",
                    "--teacher_model.attn_implementation", "flex_attention")
    assert "teacher_distributed.cp_size: 1" in found["teacher_model.attn_implementation"]
    found = _issues(kd_config, 1, "--teacher_distributed.dp_size", "1")
    assert "only with separate_meshes: true" in found["teacher_distributed"]
    found = _issues(kd_config, 1, "--kd_loss_fn", "{_target_: automodel_llm.kd.KDLoss, temperature: 3.0}")
    assert "kd_loss_fn builds its loss with temperature 3.0" in found["temperature"]


def test_the_teachers_tensor_parallel_ranks_count_in_the_split_and_its_sizes_are_checked(kd_config):
    found = _issues(kd_config, 3, "--separate_meshes", "true", "--distributed.dp_size", "1",
                    "--teacher_distributed.tp_size", "3")
    assert "the teacher's 3 rank(s) (teacher_distributed.dp_size x tp_size x cp_size x pp_size)" in \
        found["teacher_distributed.dp_size"]
    assert "launch with --nproc-per-node 4" in found["teacher_distributed.dp_size"]
    assert "3 does not divide the model's" in found["teacher_distributed.tp_size"]


def test_the_student_layout_is_validated_on_the_students_ranks(kd_config):
    with planned_world_size(3, "--nproc-per-node 3"):
        _, cfg = load_config(kd_config, "--separate_meshes", "true", "--distributed.dp_size", "2",
                             "--teacher_distributed.strategy", "ddp", route=("kd", "llm"))
    assert cfg.resolved["separate_meshes"] is True


def test_the_upstream_form_of_a_pipeline_or_context_parallel_teacher_validates():
    """upstream_forms/kd_separate_mesh_teacher.yaml (upstream's ``..._teacher_pp2`` form; ``_teacher_cp2`` by
    override) on its 4 ranks; its teacher cut into 3 stages is refused for its 2 layers."""
    from pathlib import Path

    form = Path(__file__).parent / "upstream_forms" / "kd_separate_mesh_teacher.yaml"
    with planned_world_size(4, "--nproc-per-node 4"):
        _, cfg = load_config(form, route=("kd", "llm"))
        assert cfg.resolved["teacher_distributed"]["pipeline"]["pp_schedule"] == "1f1b"
        _, cfg = load_config(form, "--teacher_distributed.pp_size", "1", "--teacher_distributed.cp_size", "2",
                             "--teacher_distributed.pipeline", "null", route=("kd", "llm"))
        assert cfg.resolved["teacher_distributed"]["cp_size"] == 2
    found = _issues(form, 5, "--teacher_distributed.pp_size", "3")
    assert "each stage needs a layer" in found["teacher_distributed.pp_size"]


def _link_rank(rank: int, rendezvous: str, results) -> None:
    """One rank of a 1 student + 1 teacher link: the student asks for a batch of every kind of tensor a run sends,
    the teacher answers with a bf16 function of it."""
    import torch

    from automodel.training.distillation.link import TeacherLink
    from automodel.training.distillation.ranks import RankSplit

    link = TeacherLink(RankSplit(students=1, teachers=1), rank, 1.0, rendezvous)
    try:
        if rank == 1:
            results.put(("served", link.serve(lambda b: (b["x"] * b["mask"]).to(torch.bfloat16) + b["n"],
                                              torch.device("cpu"))))
            return
        batch = {"x": torch.randn(2, 3), "mask": torch.tensor([[True, False, True]] * 2), "n": torch.tensor(3),
                 "empty": torch.zeros(0, 4, dtype=torch.int64)}
        answers = [link.teacher_logits(batch) for _ in range(2)]
        link.stop()
        expected = (batch["x"] * batch["mask"]).to(torch.bfloat16) + 3
        results.put(("equal", all(a.dtype == torch.bfloat16 and torch.equal(a, expected) for a in answers)))
    finally:
        link.close()


def test_the_link_carries_any_dtype_and_shape_both_ways(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_link_rank, args=(rank, rendezvous, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert dict(results.get(timeout=1) for _ in ranks) == {"served": 2, "equal": True}
