"""Upstream NeMo AutoModel's config-level forms (issue 20): each project-written config in upstream_forms/ validates
and trains 3 steps on a tiny Llama, through `automodel run -c` and `automodel finetune llm -c` (subprocesses) and
in-process for the rest; each form's effect is checked on what was built or trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel.errors import ConfigError
from automodel.testing import checkpoint_dirs, read_jsonl, run_cli, train_inprocess

FORMS = Path(__file__).parent / "upstream_forms"


def _trained_three_steps(cwd: Path) -> list[float]:
    records = read_jsonl(cwd / "checkpoints" / "training.jsonl")
    assert records and records[-1]["step"] == 3
    assert checkpoint_dirs(cwd / "checkpoints") == ["epoch_0_step_3"]
    return [r["loss"] for r in records]


def test_bare_recipe_name_runs_under_automodel_run(tmp_path):
    result = run_cli("run", "-c", FORMS / "recipe_bare_name.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _trained_three_steps(tmp_path)


def test_dotted_recipe_string_runs_under_its_route(tmp_path):
    result = run_cli("finetune", "llm", "-c", FORMS / "recipe_dotted_string.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _trained_three_steps(tmp_path)


def test_recipe_for_another_route_or_none_here_is_refused(tmp_path):
    other = run_cli("finetune", "llm", "-c", FORMS / "recipe_bare_name.yaml", "--recipe", "TrainBiEncoderRecipe",
                    cwd=tmp_path)
    assert other.returncode == 2 and "automodel run -c FILE" in other.stderr
    absent = run_cli("run", "-c", FORMS / "recipe_bare_name.yaml", "--recipe", "TrainVispecRecipe",
                     cwd=tmp_path)
    assert absent.returncode == 2
    assert "'TrainVispecRecipe' names no recipe installed here" in absent.stderr
    assert "finetune llm / pretrain llm" in absent.stderr and "Traceback" not in absent.stderr


@pytest.mark.parametrize("form", ["collate_fn_target_node", "config_references", "env_interpolation",
                                  "dist_env_init_method", "model_backend", "metadata_sections"])
def test_form_trains_three_steps_in_process(form, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train_inprocess(FORMS / f"{form}.yaml")
    _trained_three_steps(tmp_path)


def test_collate_fn_nodes_are_passed_as_the_function_or_a_partial(tmp_path, monkeypatch):
    from automodel_llm.datasets.collate import default_collater

    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(FORMS / "collate_fn_target_node.yaml", setup_only=True)
    assert recipe.dataloader.collate_fn.fn is default_collater
    partial = recipe.val_dataloaders["validation"].collate_fn.fn
    assert partial.func is default_collater and partial.keywords == {"pad_seq_len_divisible": 16}
    lengths = {batch["input_ids"].shape[-1] for batch in recipe.val_dataloaders["validation"]}
    assert lengths and all(n % 16 == 0 for n in lengths)  # the partial's argument acts
    assert any(batch["input_ids"].shape[-1] % 16 for batch in recipe.dataloader)  # without it: unpadded


def test_references_take_the_referenced_values(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(FORMS / "config_references.yaml", "--_vars.samples", "20", setup_only=True)
    assert len(recipe.train_dataset) == 20  # an override of the referenced key reaches every reference
    assert recipe.optimizer.param_groups[0]["lr"] == 2.0e-3
    import automodel_llm

    cfg, squad = recipe.cfg, str(Path(automodel_llm.__file__).parent / "examples" / "assets" / "tiny_squad")
    assert cfg.validation_dataset["dataset_name"] == cfg.dataset["dataset_name"] == squad  # interpolated there
    assert cfg.resolved["_vars"]["squad"].startswith("${pkg:")  # the holder itself is left as written
    assert cfg.step_scheduler.val_check_interval == 3
    assert "'_vars' (a top-level key starting with '_')" in capsys.readouterr().err


def test_top_level_seed_is_the_runs_seed(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    every_step = ("--step_scheduler.log_interval", "1")
    recipe = train_inprocess(FORMS / "top_level_seed.yaml", *every_step)
    assert (recipe.cfg.rng.seed, recipe.cfg.rng.ranked) == (1234, True)
    by_seed = _trained_three_steps(tmp_path / "a")
    monkeypatch.chdir(tmp_path / "b")
    train_inprocess(FORMS / "top_level_seed.yaml", *every_step, "--seed", "null", "--rng.seed", "1234",
                    "--rng.ranked", "true")
    assert len(by_seed) == 3 and _trained_three_steps(tmp_path / "b") == by_seed
    recipe = train_inprocess(FORMS / "top_level_seed.yaml", "--rng.seed", "7", setup_only=True)
    assert recipe.cfg.rng.seed == 1234  # upstream's recipes read only the top-level seed
    assert any(n.startswith("note: seed: 1234 is the value that acts, not rng.seed: 7") for n in recipe.cfg.notes)


def test_dist_env_init_method_of_a_one_process_run_is_noted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(FORMS / "dist_env_init_method.yaml", setup_only=True)
    assert recipe.cfg.dist_env.init_method == "env://"
    assert "note: dist_env init_method=env://: the rendezvous of a multi-process run" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="dist_env.init_method: 'nccl://x' is not a rendezvous URL"):
        train_inprocess(FORMS / "dist_env_init_method.yaml", "--dist_env.init_method", "nccl://x", setup_only=True)


def test_model_backend_selects_the_attention_or_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = train_inprocess(FORMS / "model_backend.yaml", setup_only=True)
    assert recipe.model.config._attn_implementation == "sdpa"
    recipe.checkpointer.release()  # the run lock of its checkpoint_dir, for the next setup in this process
    eager = train_inprocess(FORMS / "model_backend.yaml", "--model.backend.attn", "eager", setup_only=True)
    assert eager.model.config._attn_implementation == "eager"
    assert "backend" not in eager.model.config.to_dict()  # never written into the saved config.json
    with pytest.raises(ConfigError) as info:
        train_inprocess(FORMS / "model_backend.yaml", "--model.backend.attn", "te", "--model.backend.linear", "te",
                        "--model.backend.dispatcher", "deepep", setup_only=True)
    issues = {i.key: i.message for i in info.value.issues}
    assert set(issues) == {"model.backend.attn", "model.backend.linear", "model.backend.dispatcher"}
    assert all("needs CUDA" in message for message in issues.values())


def test_metadata_sections_are_named_once_and_left_unread(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CI_ONLY_TOKEN", raising=False)
    recipe = train_inprocess(FORMS / "metadata_sections.yaml", setup_only=True)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: not validated")]
    assert notes == ["note: not validated and read by nothing in the run: 'ci' (upstream's CI settings, which its "
                     "CI tooling reads), '_chat_template' (a top-level key starting with '_'), "
                     "'_validation_dataset_set_aside' (a top-level key starting with '_')"]
    assert recipe.cfg.resolved["ci"]["checkpoint_robustness"]["hf_token"] == "${CI_ONLY_TOKEN}"
