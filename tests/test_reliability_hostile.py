"""Hostile configs through the LLM route: no injection resolves or runs in ``validate``, ``--dry-run`` or a real
run, and the config.yaml saved with a checkpoint keeps ``${VAR}`` placeholders, never secrets.

automodel-core/tests/test_injection.py covers the resolver and validation in depth, and tests/test_cli_injection.py
``validate`` and real runs of a plugin route (``finetune world``). This module adds what they do not: ``--dry-run``,
real ``finetune llm`` runs where each injection sits in a section the LLM recipe really builds (model, optimizer,
data set, tokenizer, loss, scheduler, collate function, ...), the allow-list environment variable naming the
dangerous modules, and the checkpoint's saved config. A sentinel file that every injection would create (or
``precious/`` that one would delete) proves that nothing ran.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import yaml

from automodel.testing import write_yaml

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

# What a user might set to "allow" them: it must unlock none of the injections.
HOSTILE_ALLOW = "os,subprocess,builtins,importlib,pickle,shutil,torch.os,torch.serialization,numpy"


class _Evil:
    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.sentinel}",))


def injections(cwd: Path) -> list[tuple[str, str, str, object]]:
    """(id, section, dotted key the refusal names, node placed at that key) for the files under ``cwd``."""
    sentinel = str(cwd / "sentinel")
    touch = f"touch {sentinel}"
    return [
        ("os.system", "model", "model._target_", {"_target_": "os.system", "command": touch}),
        ("subprocess.run", "optimizer", "optimizer._target_",
         {"_target_": "subprocess.run", "args": ["touch", sentinel]}),
        ("subprocess.Popen", "lr_scheduler", "lr_scheduler._target_",
         {"_target_": "subprocess.Popen", "args": ["touch", sentinel]}),
        ("builtins.eval", "loss_fn", "loss_fn._target_",
         {"_target_": "builtins.eval", "source": f"open({sentinel!r}, 'w')"}),
        ("builtins.exec-nested", "dataset.seed", "dataset.seed._target_",
         {"_target_": "builtins.exec", "source": f"open({sentinel!r}, 'w')"}),
        ("importlib.import_module", "validation_dataset", "validation_dataset._target_",
         {"_target_": "importlib.import_module", "name": "amt_sentinel_mod"}),
        ("pickle.loads", "model.config", "model.config._target_",
         {"_target_": "pickle.loads", "data": pickle.dumps(_Evil(sentinel))}),
        ("torch.load-pickle", "tokenizer", "tokenizer._target_",
         {"_target_": "torch.load", "f": str(cwd / "evil.pkl"), "weights_only": False}),
        ("numpy.load-pickle", "peft", "peft._target_",
         {"_target_": "numpy.load", "file": str(cwd / "evil.pkl"), "allow_pickle": True}),
        ("private-attribute", "optimizer", "optimizer._target_", {"_target_": "torch.nn.Module._apply"}),
        ("walk-torch.os", "optimizer", "optimizer._target_", {"_target_": "torch.os.system", "command": touch}),
        ("walk-importlib", "model", "model._target_",
         {"_target_": "automodel.config.targets.importlib.import_module", "name": "amt_sentinel_mod"}),
        ("walk-shutil.rmtree", "loss_fn", "loss_fn._target_",
         {"_target_": "automodel.training.checkpoint.shutil.rmtree", "path": str(cwd / "precious")}),
        ("file-path-target", "model", "model._target_", {"_target_": f"{cwd / 'evil.py'}:f"}),
        ("relative-file-target", "dataset", "dataset._target_", {"_target_": "./evil.py"}),
        ("collate_fn-string", "dataloader.collate_fn", "dataloader.collate_fn", "os.system"),
        ("validation-collate_fn-string", "validation_dataloader.collate_fn", "validation_dataloader.collate_fn",
         "subprocess.getoutput"),
        ("target-from-env", "lr_scheduler", "lr_scheduler._target_",
         {"_target_": "${AMT_EVIL_TARGET}", "args": ["touch", sentinel]}),
    ]


IDS = [case[0] for case in injections(Path("/x"))]


@pytest.fixture
def hostile_dir(tmp_path, monkeypatch):
    """cwd with the files the injections would use; ``amt_sentinel_mod`` importable, so only the guard stops it."""
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Evil(str(tmp_path / "sentinel"))))
    (tmp_path / "amt_sentinel_mod.py").write_text(f"open({str(tmp_path / 'sentinel')!r}, 'w').close()\n")
    (tmp_path / "evil.py").write_text(f"def f():\n    open({str(tmp_path / 'sentinel')!r}, 'w').close()\n")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "keep.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AMT_EVIL_TARGET", "subprocess.check_call")
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", HOSTILE_ALLOW)
    monkeypatch.delenv("AUTOMODEL_DEBUG", raising=False)
    yield tmp_path
    sys.modules.pop("amt_sentinel_mod", None)


def _place(config: dict, dotted: str, node: object) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        config = config.setdefault(part, {})
    config[parts[-1]] = copy.deepcopy(node)


def _config(cwd: Path, cases) -> Path:
    config = h.run_config(h.write_tiny_llama(cwd / "model"), step_scheduler={"max_steps": 1})
    config["validation_dataset"] = dict(config["dataset"], split="validation")
    for _, section, _, node in cases:
        _place(config, section, node)
    return write_yaml(cwd / "hostile.yaml", config)


def assert_nothing_ran(cwd: Path, text: str) -> None:
    assert not (cwd / "sentinel").exists(), text
    assert (cwd / "precious" / "keep.txt").exists(), text
    assert "amt_sentinel_mod" not in sys.modules
    assert not list(cwd.glob("ckpt/epoch_*")) and not (cwd / "ckpt" / "training.jsonl").exists()


MODES = {"validate": ["validate", "finetune", "llm"], "dry-run": ["finetune", "llm", "--dry-run"],
         "run": ["finetune", "llm"]}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case_id", IDS)
def test_injection_is_refused(case_id, mode, hostile_dir, capsys):
    from automodel.cli.main import main

    case = next(c for c in injections(hostile_dir) if c[0] == case_id)
    config = _config(hostile_dir, [case])
    capsys.readouterr()
    rc = main([*MODES[mode], "-c", str(config)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text
    assert f"{case[2]}: " in text, text
    assert "refused" in text or "not allowed" in text or "file path" in text or "private" in text \
        or "not under an allowed" in text, text
    assert "Traceback" not in text and "dry run: nothing was built" not in text
    assert_nothing_ran(hostile_dir, text)


def test_python_yaml_tag_is_refused_in_every_mode(hostile_dir, capsys):
    from automodel.cli.main import main

    config = _config(hostile_dir, [])
    text = config.read_text() + f"ci:\n  x: !!python/object/apply:os.system ['touch {hostile_dir / 'sentinel'}']\n"
    config.write_text(text)
    for argv in MODES.values():
        capsys.readouterr()
        assert main([*argv, "-c", str(config)]) == 2
        err = capsys.readouterr().err
        assert "!!python/object/apply:os.system is not allowed" in err and "Traceback" not in err
    assert_nothing_ran(hostile_dir, "")


def test_every_injection_at_once_through_the_console_script(hostile_dir):
    """A real run of the real CLI: one refusal lists them all, before anything is built."""
    chosen: dict[str, tuple] = {}
    for case in injections(hostile_dir):  # one per place; whole sections first, then keys nested inside them
        chosen.setdefault(case[1], case)
    cases = sorted(chosen.values(), key=lambda c: c[1].count("."))
    assert len(cases) >= 12
    config = _config(hostile_dir, cases)
    env = h.cli_env(AMT_EVIL_TARGET="subprocess.check_call", AUTOMODEL_ALLOW_TARGETS=HOSTILE_ALLOW,
                    PYTHONPATH=str(hostile_dir))
    proc = subprocess.run(h.cli_command("finetune", "llm", "-c", config), cwd=hostile_dir, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    keys = {case[2] for case in cases}
    # the arguments that unpickle are refused too, whatever the target (weights_only: false, allow_pickle: true)
    keys |= {f"{section}.{arg}" for _, section, _, node in cases if isinstance(node, dict)
             for arg, bad in (("weights_only", False), ("allow_pickle", True)) if node.get(arg) is bad}
    for key in keys:
        assert f"  - {key}: " in proc.stderr, (key, proc.stderr)
    assert f"({len(keys)} problems)" in proc.stderr
    assert "pipeline:" not in proc.stderr  # refused before setup
    assert_nothing_ran(hostile_dir, proc.stderr)


def test_saved_config_keeps_placeholders_and_masks_secrets(tmp_path, monkeypatch, capsys):
    from automodel.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AUTOMODEL_ALLOW_TARGETS", raising=False)
    secret, literal = "hf_s3cr3t_from_the_environment", "sk-literal-given-on-the-command-line"
    assets = h.llm_assets()
    monkeypatch.setenv("AMT_REL_HF_TOKEN", secret)
    monkeypatch.setenv("AMT_REL_ASSETS", str(assets))
    config = h.run_config(h.write_tiny_llama(tmp_path / "model"), step_scheduler={"max_steps": 1})
    config["tokenizer"] = {"pretrained_model_name_or_path": "${AMT_REL_ASSETS}/tiny_tokenizer",
                           "token": "${AMT_REL_HF_TOKEN}"}
    config["dataset"]["dataset_name"] = "${AMT_REL_ASSETS}/tiny_squad"
    write_yaml(tmp_path / "cfg.yaml", config)
    capsys.readouterr()
    assert main(["finetune", "llm", "-c", "cfg.yaml", "--ci.api_key", literal]) == 0, capsys.readouterr().err
    output = capsys.readouterr()
    saved_text = (tmp_path / "ckpt" / "epoch_0_step_1" / "config.yaml").read_text()
    saved = yaml.safe_load(saved_text)
    assert saved["tokenizer"] == {"pretrained_model_name_or_path": "${AMT_REL_ASSETS}/tiny_tokenizer",
                                  "token": "${AMT_REL_HF_TOKEN}"}
    assert saved["dataset"]["dataset_name"] == "${AMT_REL_ASSETS}/tiny_squad"
    assert saved["ci"] == {"api_key": "***"}
    assert str(assets) not in saved_text
    for path in (tmp_path / "ckpt").rglob("*"):  # no file of the run holds either secret
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and literal.encode() not in data, path
    assert secret not in output.out + output.err and literal not in output.out + output.err
    # and --print-config shows the same
    assert main(["finetune", "llm", "-c", "cfg.yaml", "--ci.api_key", literal, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "${AMT_REL_HF_TOKEN}" in printed and secret not in printed and literal not in printed



def test_positive_control_an_allowed_target_runs_in_a_real_run_only(hostile_dir, monkeypatch, capsys):
    """The sentinel does appear when an allowed target is called: in a real run, not in validate or --dry-run."""
    from automodel.cli.main import main

    (hostile_dir / "amt_touch.py").write_text("def touch(path, **kwargs):\n    open(path, 'w').close()\n")
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", "amt_touch")
    config = _config(hostile_dir, [("touch", "model", "model", {"_target_": "amt_touch.touch",
                                                                 "path": str(hostile_dir / "sentinel")})])
    for mode in ("validate", "dry-run"):
        assert main([*MODES[mode], "-c", str(config)]) == 0, capsys.readouterr().err
        assert not (hostile_dir / "sentinel").exists(), mode
    capsys.readouterr()
    assert main([*MODES["run"], "-c", str(config)]) == 1  # it did call the target; its None is not a model
    assert "model: amt_touch.touch returned NoneType, not a torch.nn.Module" in capsys.readouterr().err
    assert (hostile_dir / "sentinel").exists()
    sys.modules.pop("amt_touch", None)
