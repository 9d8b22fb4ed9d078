"""Metric logging backends end to end on the tiny LLM run: TensorBoard, MLflow (local file store), W&B offline.

One shared 6-step run (validation every 3 steps) feeds every installed backend plus an in-test recording
backend, and the tests read each backend's output back with its own reader. A backend whose package is not
installed has its test skipped (its extra: ``pip install automodel-core[tensorboard|mlflow|wandb]``).
Validation tests (unknown names, missing packages, upstream-style sections) build nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("automodel_llm", reason="the logging tests train the tiny Llama that automodel-llm ships")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's chatter

from automodel import hookimpl  # noqa: E402
from automodel.errors import ConfigError  # noqa: E402
from automodel.plugins.manager import PluginManager, reset_plugin_manager  # noqa: E402
from automodel.training.logging import MetricLogger, module_available, resolve_backends  # noqa: E402

ASSETS = Path(importlib.util.find_spec("automodel_llm").submodule_search_locations[0]) / "examples" / "assets"
SQUAD = ASSETS / "tiny_squad"
TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}
SECRET = "sk-DO-NOT-LEAK-4242"  # distinctive, so that a byte scan of every output file can find it
MISSING_MODULE = "amt_no_such_backend_module"


# ---- an in-test backend that records what the loop feeds it, and one whose package is missing ---------------

CALLS: list[tuple[str, Any]] = []


class Recorder(MetricLogger):
    def __init__(self, settings, context):
        super().__init__(settings, context)
        CALLS.append(("init", {"settings": settings, "checkpoint_dir": context.checkpoint_dir}))

    def log_config(self, config):
        CALLS.append(("config", copy.deepcopy(config)))

    def log_train(self, sample, step):
        CALLS.append(("train", (step, dict(sample))))

    def log_validation(self, record, step):
        CALLS.append(("validation", (step, dict(record))))

    def log_model(self, model_dir):
        CALLS.append(("model", Path(model_dir)))

    def close(self, status):
        CALLS.append(("close", status))


class NeedsMissingPackage(MetricLogger):
    requires = (MISSING_MODULE,)
    install_hint = "pip install automodel-core[fancy]"


class LoggersPlugin:
    @hookimpl
    def automodel_register_loggers(self, loggers):
        loggers.add("recorder", Recorder)
        loggers.add("fancy", NeedsMissingPackage)


@pytest.fixture(scope="module")
def manager():
    """The installed plugins (core + domains) plus the two test backends, as the process-wide manager."""
    mgr = PluginManager(extra_plugins=[("test-loggers", LoggersPlugin())])
    reset_plugin_manager(mgr)
    yield mgr
    reset_plugin_manager(None)


# ---- tiny runs ------------------------------------------------------------------------------------------------

def write_config(directory: Path, **sections: Any) -> Path:
    """The tiny LLM run (as automodel-llm's tests configure it), ``sections`` replacing top-level sections."""
    model_config = json.loads((ASSETS / "tiny_llama" / "config.json").read_text())
    model_config.update(TINY_LLAMA)
    (directory / "tiny_llama.json").write_text(json.dumps(model_config))
    data = {
        "step_scheduler": {"max_steps": 6, "grad_accumulation_steps": 1, "log_interval": 1, "num_epochs": 100,
                           "val_check_interval": 3},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_config",
                  "config": str(directory / "tiny_llama.json")},
        "tokenizer": {"pretrained_model_name_or_path": str(ASSETS / "tiny_tokenizer")},
        "dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD), "split": "train",
                    "max_seq_length": 64, "limit_dataset_samples": 32},
        "validation_dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD),
                               "split": "validation", "max_seq_length": 64, "limit_dataset_samples": 8},
        "dataloader": {"batch_size": 4},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3},
        "checkpoint": {"checkpoint_dir": str(directory / "ckpt")},
        "eval_generation": {"enabled": False},
    }
    data.update(sections)
    path = directory / "cfg.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}, sort_keys=False))
    return path


def validate(manager, config: Path, *overrides: str):
    from automodel.cli.execute import import_recipe, load_and_validate

    recipe_cls = import_recipe(manager.routes.get("finetune", "llm").recipe)
    return load_and_validate(recipe_cls, config, list(overrides), manager)


def train(manager, config: Path, before_run=None):
    """Validate and train in this process, as the CLI does; returns the recipe after training."""
    from automodel.cli.execute import import_recipe

    recipe = import_recipe(manager.routes.get("finetune", "llm").recipe)(validate(manager, config))
    recipe.setup()
    if before_run is not None:
        before_run(recipe)
    recipe.run_train_validation_loop()
    return recipe


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def backend_env(tmp_path_factory):
    """No user tracking settings leak in; W&B's config/cache dirs stay in tmp; MLflow's file store is allowed."""
    home = tmp_path_factory.mktemp("backend_home")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY",
                     "WANDB_RUN_ID", "WANDB_API_KEY"):
            mp.delenv(name, raising=False)
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # set here so the tests' own readers may open the store
        mp.setenv("WANDB_CONFIG_DIR", str(home / "wandb_config"))
        mp.setenv("WANDB_CACHE_DIR", str(home / "wandb_cache"))
        mp.setenv("WANDB_DATA_DIR", str(home / "wandb_data"))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield mp


@dataclass
class Run:
    root: Path
    ckpt: Path
    recipe: Any
    calls: list[tuple[str, Any]]
    mlflow_uri: str | None
    wandb_dir: Path | None


@pytest.fixture(scope="module")
def run(manager, backend_env, tmp_path_factory) -> Run:
    """One tiny run into every installed backend: TensorBoard through ``logging.backends``, MLflow through
    ``logging.mlflow`` settings, W&B through an upstream-style top-level ``wandb:`` section (offline)."""
    root = tmp_path_factory.mktemp("logged_run")
    logging_section: dict[str, Any] = {"backends": ["recorder"] + (["tensorboard"] if module_available("tensorboard")
                                                                   else [])}
    sections: dict[str, Any] = {"ci": {"hf_token": "abc", "api_key": SECRET}}
    mlflow_uri = wandb_dir = None
    if module_available("mlflow"):
        mlflow_uri = f"file:{root / 'mlruns'}"
        logging_section["mlflow"] = {"tracking_uri": mlflow_uri, "experiment_name": "tiny-exp",
                                     "run_name": "tiny-run", "tags": {"team": "t"}}
    if module_available("wandb"):
        wandb_dir = root / "wb"
        sections["wandb"] = {"project": "p", "entity": "e", "name": "n", "save_dir": str(wandb_dir),
                             "mode": "offline"}
    sections["logging"] = logging_section
    CALLS.clear()
    recipe = train(manager, write_config(root, **sections))
    return Run(root, root / "ckpt", recipe, list(CALLS), mlflow_uri, wandb_dir)


# ---- the loop feeds the backends --------------------------------------------------------------------------------

def test_the_loop_feeds_every_backend_what_it_writes_to_the_jsonl_files(run):
    kinds = [kind for kind, _ in run.calls]
    assert kinds[:2] == ["init", "config"] and kinds[-2:] == ["model", "close"]
    assert kinds.count("init") == kinds.count("config") == kinds.count("close") == 1
    assert run.calls[0][1]["checkpoint_dir"] == run.ckpt
    train_rows, val_rows = read_jsonl(run.ckpt / "training.jsonl"), read_jsonl(run.ckpt / "validation.jsonl")
    assert [step for step, _ in (v for k, v in run.calls if k == "train")] == [1, 2, 3, 4, 5, 6]
    assert [sample for k, (_, sample) in ((k, v) for k, v in run.calls if k == "train")] == train_rows
    assert [(step, record) for k, (step, record) in ((k, v) for k, v in run.calls if k == "validation")] == \
        [(r["step"], r) for r in val_rows]
    assert [r["step"] for r in val_rows] == [3, 6]
    assert dict(run.calls)["model"] == run.recipe.final_checkpoint / "model"
    assert (dict(run.calls)["model"] / "config.json").is_file()
    assert run.calls[-1] == ("close", "success")


def test_secrets_never_reach_a_backend(run):
    assert run.recipe.cfg.raw["ci"]["api_key"] == SECRET  # the run really had the secret
    config = dict(run.calls)["config"]
    assert config["ci"] == {"hf_token": "***", "api_key": "***"}
    assert config["optimizer"]["lr"] == 3.0e-3  # ordinary keys pass through
    outputs = [p for p in run.root.rglob("*") if p.is_file() and p.name != "cfg.yaml"]  # all but the input
    leaked = [str(p) for p in outputs if SECRET.encode() in p.read_bytes()]
    assert leaked == []
    assert any(run.root.rglob("*.safetensors"))  # the scan covered real output


# ---- TensorBoard ---------------------------------------------------------------------------------------------------

def test_tensorboard_scalars_match_training_jsonl(run):
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed: pip install automodel-core[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.ckpt / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    train_rows, val_rows = read_jsonl(run.ckpt / "training.jsonl"), read_jsonl(run.ckpt / "validation.jsonl")
    numeric = [k for k in ("epoch", "loss", "grad_norm", "lr", "mem", "tps", "mfu")
               if any(isinstance(row[k], (int, float)) for row in train_rows)]
    assert {"loss", "grad_norm", "lr", "mem", "tps"} <= set(numeric)
    assert {f"train/{k}" for k in numeric} | {"val/val_loss", "val/num_label_tokens"} == tags
    for name, rows, prefix in [(k, train_rows, "train/") for k in numeric] + \
                              [(k, val_rows, "val/") for k in ("val_loss", "num_label_tokens")]:
        got = events.Scalars(prefix + name)
        want = [row for row in rows if row[name] is not None]
        assert [e.step for e in got] == [row["step"] for row in want], name
        assert [e.value for e in got] == pytest.approx([row[name] for row in want], rel=1e-6), name
        assert [e.wall_time for e in got] == pytest.approx([row["timestamp"] for row in want], abs=1e-3), name


# ---- MLflow -------------------------------------------------------------------------------------------------------

def test_mlflow_file_store_run_has_params_metrics_and_loadable_model(run, tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed: pip install automodel-core[mlflow]")
    from mlflow.tracking import MlflowClient

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(run.mlflow_uri)
    try:
        runs = mlflow.search_runs(experiment_names=["tiny-exp"], filter_string="attributes.run_name = 'tiny-run'",
                                  output_format="list")
    finally:
        mlflow.set_tracking_uri(previous)
    assert len(runs) == 1
    found = runs[0]
    assert found.info.status == "FINISHED"
    params = found.data.params
    assert params["ci.hf_token"] == "***" and params["ci.api_key"] == "***"
    assert params["optimizer.lr"] == "0.003" and params["optimizer._target_"] == "torch.optim.AdamW"
    assert params["step_scheduler.max_steps"] == "6" and params["dataloader.batch_size"] == "4"
    assert found.data.tags["team"] == "t"

    client = MlflowClient(run.mlflow_uri)
    train_rows, val_rows = read_jsonl(run.ckpt / "training.jsonl"), read_jsonl(run.ckpt / "validation.jsonl")
    for key, rows, field in (("train/loss", train_rows, "loss"), ("train/lr", train_rows, "lr"),
                             ("val/val_loss", val_rows, "val_loss")):
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert history == [(row["step"], pytest.approx(row[field], rel=1e-12)) for row in rows], key

    model_dir = mlflow.artifacts.download_artifacts(run_id=found.info.run_id, artifact_path="model",
                                                    dst_path=str(tmp_path), tracking_uri=run.mlflow_uri)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    saved = {}
    for file in (run.recipe.final_checkpoint / "model").glob("*.safetensors"):
        saved.update(load_file(str(file)))
    state = model.state_dict()
    assert saved and all(name in state and state[name].equal(tensor) for name, tensor in saved.items())


@pytest.mark.parametrize("how, status, mlflow_status", [("error", "failed", "FAILED"),
                                                        ("sigterm", "stopped", "KILLED")])
def test_backends_are_closed_with_the_run_outcome(manager, backend_env, tmp_path, how, status, mlflow_status):
    logging_section: dict[str, Any] = {"backends": ["recorder"]}
    uri = f"file:{tmp_path / 'mlruns'}"
    if module_available("mlflow"):
        logging_section["mlflow"] = {"tracking_uri": uri, "experiment_name": "outcome", "run_name": how}
    config = write_config(tmp_path, logging=logging_section, validation_dataset=None,
                          step_scheduler={"max_steps": 4, "log_interval": 1})

    def interrupt_at_step_2(recipe):
        def after_step(step, tokens, seconds):
            if step == 2:
                if how == "error":
                    raise RuntimeError("boom at step 2")
                os.kill(os.getpid(), signal.SIGTERM)  # the graceful stop: checkpoint, then TrainingStopped
        recipe.after_step = after_step

    CALLS.clear()
    with pytest.raises(Exception, match="boom at step 2" if how == "error" else "stopped by SIGTERM after step 2"):
        train(manager, config, before_run=interrupt_at_step_2)
    kinds = [kind for kind, _ in CALLS]
    assert CALLS[-1] == ("close", status) and "model" not in kinds
    assert [v[0] for k, v in CALLS if k == "train"] == ([1] if how == "error" else [1, 2])
    if module_available("mlflow"):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        (found,) = client.search_runs([client.get_experiment_by_name("outcome").experiment_id])
        assert found.info.status == mlflow_status


def test_only_rank_0_feeds_the_backends(manager, backend_env, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # what a second torchrun rank's process sees (one process here: no collectives)
    # no checkpoint: every rank writes its part of one and rank 0 publishes it, and there is no rank 0 here
    config = write_config(tmp_path, logging={"backends": ["recorder"]}, validation_dataset=None,
                          step_scheduler={"max_steps": 2, "log_interval": 1},
                          checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "enabled": False})
    CALLS.clear()
    recipe = train(manager, config)
    assert recipe.step_scheduler.step == 2 and not recipe.is_main_process
    assert CALLS == [] and recipe.metric_loggers.names == []


# ---- Weights & Biases ---------------------------------------------------------------------------------------------

def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``run-<id>.wandb`` transaction log (W&B's LevelDB-style log format)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:  # FULL
            pending, whole = b"", chunk
        elif kind in (2, 3):  # FIRST, MIDDLE
            pending += chunk
            continue
        else:  # LAST
            pending, whole = b"", pending + chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(whole)
        records.append(record)
    return records


def test_wandb_offline_run_directory_has_the_metrics(run):
    pytest.importorskip("wandb", reason="W&B is not installed: pip install automodel-core[wandb]")
    (run_dir,) = (run.wandb_dir / "wandb").glob("offline-run-*")  # what `wandb sync` uploads later
    (log,) = run_dir.glob("run-*.wandb")
    records = read_wandb_records(log)
    by_kind: dict[str, list[Any]] = {}
    for record in records:
        by_kind.setdefault(record.WhichOneof("record_type"), []).append(record)
    (run_record,) = by_kind["run"]
    assert (run_record.run.project, run_record.run.entity, run_record.run.display_name) == ("p", "e", "n")

    rows: dict[int, dict[str, Any]] = {}
    for record in by_kind.get("history", []):
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        rows.setdefault(items["_step"], {}).update(items)
    train_rows, val_rows = read_jsonl(run.ckpt / "training.jsonl"), read_jsonl(run.ckpt / "validation.jsonl")
    assert sorted(rows) == [row["step"] for row in train_rows]
    for row in train_rows:
        assert rows[row["step"]]["train/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert rows[row["step"]]["train/lr"] == pytest.approx(row["lr"], rel=1e-12)
    for row in val_rows:
        assert rows[row["step"]]["val/val_loss"] == pytest.approx(row["val_loss"], rel=1e-12)

    config: dict[str, Any] = {}
    for record in by_kind.get("config", []):
        for item in record.config.update:
            config[item.key] = json.loads(item.value_json)
    for item in run_record.run.config.update:
        config.setdefault(item.key, json.loads(item.value_json))
    unwrap = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    assert unwrap["ci"] == {"hf_token": "***", "api_key": "***"}
    assert unwrap["optimizer"]["lr"] == 3.0e-3
    assert [r.exit.exit_code for r in by_kind["exit"]] == [0]


# ---- validation: names, packages, settings, upstream sections -----------------------------------------------------

def _issues(manager, config: Path) -> str:
    with pytest.raises(ConfigError) as info:
        validate(manager, config)
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize("name", ["fancy", "tensorboard", "mlflow", "wandb"])
def test_a_missing_backend_package_fails_validation_with_the_extra_to_install(manager, tmp_path, monkeypatch,
                                                                              capsys, name):
    if name != "fancy":
        monkeypatch.setitem(sys.modules, name, None)  # hide the installed package
        assert not module_available(name)
    config = write_config(tmp_path, logging={"backends": [name]})
    from automodel.cli.main import main

    assert main(["finetune", "llm", "-c", str(config)]) == 2
    err = capsys.readouterr().err
    package = MISSING_MODULE if name == "fancy" else name
    assert f"logging.backends[0]: the {name} backend needs the '{package}' package, which is not installed; " \
           f"install it with `pip install automodel-core[{name}]`" in err
    assert not (tmp_path / "ckpt").exists()  # refused before anything was built


def test_unknown_backends_and_bad_settings_are_all_reported(manager, tmp_path):
    config = write_config(tmp_path, logging={"backends": ["tensorbord", "recorder"], "bogus": {},
                                             "mlflow": {"experiment": "x"}},
                          wandb={"project": "p", "enable": "no"})
    text = _issues(manager, config)
    assert "logging.backends[0]: unknown logging backend 'tensorbord'; the registered backends are: fancy, " \
           "mlflow, recorder, tensorboard, wandb (did you mean 'tensorboard'?)" in text
    assert "logging.bogus: unknown key; 'logging' accepts: backends, and the settings of a registered backend" in text
    assert "logging.mlflow.experiment: unknown key" in text and "(did you mean 'experiment_name'?)" in text
    assert "wandb.enable: expected true or false, found 'no'" in text


def test_upstream_sections_enable_flags_and_aliases(manager, tmp_path):
    pytest.importorskip("wandb", reason="W&B is not installed: pip install automodel-core[wandb]")
    pytest.importorskip("mlflow", reason="MLflow is not installed: pip install automodel-core[mlflow]")
    registry = manager.loggers
    cfg = validate(manager, write_config(tmp_path, wandb={"project": "p", "entity": "e", "name": "n",
                                                          "save_dir": "d"},
                                         mlflow={"experiment_name": "x", "run_name": ""}))
    specs = {spec.name: spec for spec in resolve_backends(cfg, registry)[0]}
    assert sorted(specs) == ["mlflow", "wandb"] and specs["wandb"].key == "wandb"
    wandb = specs["wandb"].settings
    assert (wandb.project, wandb.entity, wandb.name, wandb.dir) == ("p", "e", "n", "d")  # save_dir is dir's alias
    assert specs["mlflow"].settings.experiment_name == "x"

    cfg = validate(manager, write_config(tmp_path, logging={"backends": ["recorder", "wandb"]},
                                         wandb={"enable": False, "project": "p"}, mlflow={"enabled": False}))
    assert [spec.name for spec in resolve_backends(cfg, registry)[0]] == ["recorder"]

    text = _issues(manager, write_config(tmp_path, logging={"wandb": {"project": "a"}}, wandb={"project": "b"}))
    assert "wandb: the wandb backend's settings are given twice, as 'wandb' and as 'logging.wandb'; keep one" in text


def test_plan_lists_the_backends_and_help_imports_none_of_them(manager, tmp_path, capsys):
    from automodel.cli.main import main

    config = write_config(tmp_path, logging=["recorder"])  # a bare list is shorthand for backends
    assert main(["finetune", "llm", "-c", str(config), "--dry-run"]) == 0
    assert "logging: recorder" in capsys.readouterr().out
    probe = ("import sys\nfrom automodel.cli.main import main\nmain(['--help'])\n"
             "print(sorted(m for m in ('torch', 'tensorboard', 'mlflow', 'wandb', 'automodel.training.logging') "
             "if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stderr.strip().splitlines()[-1] == "[]", out.stderr
