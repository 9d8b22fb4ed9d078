"""Knowledge distillation of a vision-language model (``automodel kd vlm``, upstream's
``KnowledgeDistillationRecipeForVLM``) in upstream's config form (upstream_forms/kd_vlm_upstream.yaml).

The student and the teacher are tiny Llavas of different fresh weights, saved with the shipped processor. The
logged step-1 losses are checked against a hand computation with transformers' own class on the first batch (the
teacher must see the pictures for them to agree); the teacher on ranks of its own, tensor-parallel over two, gives
the losses of the run with the teacher beside the student.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from vlm_testing import LLAVA_CONFIG, SHAPES, tiny_processor

from automodel import testing
from automodel.errors import ConfigError
from automodel.testing import free_port, read_jsonl, run_cli
from automodel.training.dist import planned_world_size

FORM = Path(__file__).parent / "upstream_forms" / "kd_vlm_upstream.yaml"
ROUTE = ("kd", "vlm")
TEMPERATURE = 2.0  # the form's kd_loss_fn.temperature
EVERY_STEP = ("--step_scheduler.log_interval", "1")


def _saved_llava(directory: Path, seed: int, vocab: int = 354) -> Path:
    """The tiny Llava of fresh weights with the shipped processor; a vocabulary of 354 (the shipped 353 is odd; a
    tensor-parallel teacher's plan shards the embedding)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig.from_json_file(str(LLAVA_CONFIG))
    config.text_config.vocab_size = vocab
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(str(directory))
    tiny_processor().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def form_args(tmp_path_factory):
    """The form's SAVED_BY_THE_TEST paths: a student and a teacher of other weights, MedPix-form rows of the shipped
    shapes pictures."""
    root = tmp_path_factory.mktemp("kd_vlm")
    student, teacher = _saved_llava(root / "student", 1), _saved_llava(root / "teacher", 2)
    rows = []
    for line in (SHAPES / "train.jsonl").read_text().splitlines()[:24]:
        row = json.loads(line)
        question = next(p["text"] for p in row["messages"][0]["content"] if p["type"] == "text")
        rows.append({"image_id": str(SHAPES / row["image"]), "question": question,
                     "answer": row["messages"][1]["content"][0]["text"]})
    medpix = root / "medpix.jsonl"
    medpix.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--model.pretrained_model_name_or_path", student, "--teacher_model.pretrained_model_name_or_path", teacher,
            "--processor.pretrained_model_name_or_path", student, "--dataset.path_or_dataset", medpix,
            "--validation_dataset.path_or_dataset", medpix]


def _by_hand(student_dir: Path, teacher_dir: Path, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(cross entropy, T² x KL(teacher || student)), each per label token, of ``batch`` with transformers' class."""
    from transformers import LlavaForConditionalGeneration

    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "pixel_values")}
    with torch.no_grad():
        student, teacher = (LlavaForConditionalGeneration.from_pretrained(str(d))(**inputs).logits[:, :-1]
                            for d in (student_dir, teacher_dir))
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    ce = F.cross_entropy(student[keep], labels[keep], reduction="sum")
    s, t = (F.log_softmax(x[keep] / TEMPERATURE, dim=-1) for x in (student, teacher))
    kd = (t.exp() * (t - s)).sum() * TEMPERATURE ** 2
    return (ce / keep.sum()).item(), (kd / keep.sum()).item()


def test_the_upstream_form_logs_the_hand_computed_ce_and_kd_losses(form_args, tmp_path):
    first = testing.train_inprocess(FORM, *form_args, "--checkpoint.checkpoint_dir", tmp_path / "setup", route=ROUTE,
                                    setup_only=True)
    batch = next(iter(first.dataloader))
    assert batch["pixel_values"].shape[0] == 4
    ce, kd = _by_hand(Path(form_args[1]), Path(form_args[3]), batch)
    assert kd > 0.01, "the teacher's weights differ from the student's"

    recipe = testing.train_inprocess(FORM, *form_args, *EVERY_STEP, "--checkpoint.checkpoint_dir", tmp_path / "run",
                                     route=ROUTE)
    records = read_jsonl(tmp_path / "run" / "training.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["loss_ce"] == pytest.approx(ce, rel=1e-4)
    assert records[0]["loss_kd"] == pytest.approx(kd, rel=1e-4)
    for record in records:
        assert record["loss"] == pytest.approx(0.5 * record["loss_ce"] + 0.5 * record["loss_kd"], rel=1e-5)
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "validation.jsonl")] == [3]
    assert recipe.kd_loss_fn.chunk_size == 16 and recipe.kd_loss_fn.temperature == TEMPERATURE
    frozen = {name for name, p in recipe.model.named_parameters() if not p.requires_grad}
    assert frozen and all("vision_tower" in name for name in frozen), "freeze_config acts on the student"
    assert not any(p.requires_grad for p in recipe.teacher.parameters())


def test_a_teacher_of_the_students_weights_adds_no_distillation_loss(form_args, tmp_path):
    """The same weights on the same micro-batch (pictures included) give the same logits: KL 0 at step 1; also with
    the teacher's weights kept in host memory between its forwards (offload_teacher_model)."""
    student = form_args[1]
    recipe = testing.train_inprocess(FORM, *form_args, *EVERY_STEP, "--teacher_model.pretrained_model_name_or_path",
                                     student, "--offload_teacher_model", "true", "--step_scheduler.max_steps", "1",
                                     "--checkpoint.checkpoint_dir", tmp_path, route=ROUTE)
    assert recipe.offload_teacher and {p.device.type for p in recipe.teacher.parameters()} == {"cpu"}
    record = read_jsonl(tmp_path / "training.jsonl")[0]
    assert record["loss_kd"] == pytest.approx(0.0, abs=1e-6)
    assert record["loss"] == pytest.approx(0.5 * record["loss_ce"], rel=1e-6)


def test_a_teacher_of_another_vocabulary_is_refused_by_name(form_args, tmp_path):
    from automodel.errors import AutomodelError

    teacher = _saved_llava(tmp_path / "teacher", 2, vocab=356)
    with pytest.raises(AutomodelError, match="teacher_model: its logits cover 356 tokens, the student's 354"):
        testing.train_inprocess(FORM, *form_args, "--teacher_model.pretrained_model_name_or_path", teacher,
                                "--step_scheduler.max_steps", "1", "--checkpoint.checkpoint_dir", tmp_path / "run",
                                route=ROUTE)


def _cli(tmp_path: Path, form_args: list, *args: str) -> tuple[Path, str]:
    tmp_path.mkdir()
    directory = tmp_path / "run"
    ranks = args[args.index("--nproc-per-node") + 1] if "--nproc-per-node" in args else None
    port = ["--master-port", str(free_port())] if ranks else []
    result = run_cli("run", "-c", FORM, *map(str, form_args), *EVERY_STEP, *args, *port, "--checkpoint.checkpoint_dir",
                     directory, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-4000:]
    return directory, result.stderr


def test_a_teacher_tensor_parallel_on_ranks_of_its_own_gives_the_colocated_losses(form_args, tmp_path):
    """1 student rank + a teacher copy tensor-parallel over 2 ranks (``automodel run``) against one process with the
    teacher beside the student: the logits cross the link whole, so every logged loss is the same."""
    colocated, log = _cli(tmp_path / "colocated", form_args)
    assert "the teacher is a frozen copy on every rank of the student" in log
    separate, log = _cli(tmp_path / "separate", form_args, "--nproc-per-node", "3", "--separate_meshes", "true",
                    "--distributed.dp_size", "1", "--teacher_distributed",
                    "{strategy: fsdp2, dp_size: 1, tp_size: 2, cp_size: 1, pp_size: 1, sequence_parallel: false}")
    assert "the teacher runs on ranks 1..2 (1 copy, each tensor-parallel over 2 consecutive ranks)" in log
    for key in ("loss", "loss_ce", "loss_kd"):
        assert ([r[key] for r in read_jsonl(separate / "training.jsonl")]
                == pytest.approx([r[key] for r in read_jsonl(colocated / "training.jsonl")], rel=1e-5)), key
    assert (read_jsonl(separate / "validation.jsonl")[0]["val_loss"]
            == pytest.approx(read_jsonl(colocated / "validation.jsonl")[0]["val_loss"], rel=1e-5))


def _issues(form_args, world: int, *overrides: str) -> dict[str, str]:
    with planned_world_size(world, f"--nproc-per-node {world}"), pytest.raises(ConfigError) as info:
        testing.load_config(FORM, *form_args, *overrides, route=ROUTE)
    return {issue.key: issue.message for issue in info.value.issues}


@pytest.mark.parametrize("key,size,needle", [("cp_size", 2, "merges its images into the sequence first"),
                                             ("pp_size", 2, "vision tower and merge")])
def test_a_teacher_split_the_vlm_teacher_cannot_take_is_refused_with_the_reason(form_args, key, size, needle):
    found = _issues(form_args, 3, "--separate_meshes", "true", "--distributed.dp_size", "1",
                    f"--teacher_distributed.{key}", str(size))
    assert needle in found[f"teacher_distributed.{key}"], found


def test_keys_that_cannot_act_together_are_refused(form_args):
    found = _issues(form_args, 2, "--separate_meshes", "true", "--distributed.dp_size", "1",
                    "--offload_teacher_model", "true")
    assert "separate_meshes: true" in found["offload_teacher_model"], found
    found = _issues(form_args, 1, "--offload_teacher_model", "sometimes")
    assert "expected true or false" in found["offload_teacher_model"], found
    found = _issues(form_args, 1, "--distributed.tp_size", "2")
    assert "tp_size: 1" in found["distributed.tp_size"], found
