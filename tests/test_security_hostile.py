"""The hostile-config battery (issue 21): every red-team config, in every way a config is read — `validate`,
`--dry-run`, a real run of the LLM route, `export` of a received checkpoint holding it, and `--slurm` — is refused
(exit 2) and never creates the marker file its payload would write.

The working directory is on sys.path, as it is for every torchrun rank (`python -m automodel.cli.main`), so the
local package `evilpkg/` is importable: only the boundary stops it. tests/test_reliability_hostile.py holds the
older battery (stdlib gadgets through every section); tests/test_security_*.py test each defence in depth.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s
import yaml

from automodel.testing import write_yaml


def hostile_cases(cwd: Path) -> dict[str, tuple[str, object, str]]:
    """id -> (the dotted key where the hostile value goes, the value, the key the refusal names); each value
    would create the marker if it ever acted."""
    cases: dict[str, tuple[str, object, str]] = {
        f"gadget-{gid}": ("model", node, "model._target_") for gid, node in s.gadgets(cwd)}
    model = s.write_remote_code_model(cwd)
    cases["trust_remote_code"] = ("model", {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                                            "pretrained_model_name_or_path": str(model), "trust_remote_code": True},
                                  "model.trust_remote_code")
    cases["pkg-interpolation"] = ("ci.where", "${pkg:evilpkg}/data", "ci.where")
    cases["pkg-interpolation-dotted"] = ("ci.where", "${pkg:evilpkg.sub}/data", "ci.where")
    cases["collate_fn-string"] = ("dataloader.collate_fn", "transformers.testing_utils.run_command",
                                  "dataloader.collate_fn")
    cases["nested-deep"] = ("ci.a.b.c", [1, {"x": s.gadgets(cwd)[0][1]}], "ci.a.b.c[1].x._target_")
    cases["slurm-newline"] = ("slurm.job_name", f"job\ntouch {s.marker(cwd)}", "slurm.job_name")
    return cases


IDS = list(hostile_cases(Path("/nonexistent-security-battery")))


@pytest.fixture
def hostile(cwd, monkeypatch):
    monkeypatch.syspath_prepend(str(cwd))
    yield cwd
    sys.modules.pop("evilpkg", None)
    sys.modules.pop("evilpkg.sub", None)


def _config(cwd: Path, case_id: str) -> dict:
    config = h.run_config(h.write_tiny_llama(cwd / "tiny"), step_scheduler={"max_steps": 1})
    config["slurm"] = {"script": str(cwd / "job.sbatch")}
    config["peft"] = {"dim": 4, "alpha": 8, "target_modules": ["q_proj"]}  # a LoRA run, so export rebuilds it
    key, value, _ = hostile_cases(cwd)[case_id]
    node, parts = config, key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = copy.deepcopy(value)
    return config


def _received_checkpoint(cwd: Path, config: dict) -> Path:
    step = cwd / "received" / "epoch_0_step_1"
    (step / "model").mkdir(parents=True)
    (step / "model" / "adapter_model.safetensors").write_bytes(b"")
    (step / "model" / "adapter_config.json").write_text("{}")
    (step / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (cwd / "received" / "LATEST").write_text(step.name)
    return cwd / "received"


MODES = ["validate", "dry-run", "run", "export", "slurm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_id", IDS)
def test_no_hostile_config_runs_anything(hostile, case_id, mode):
    config = _config(hostile, case_id)
    path = write_yaml(hostile / "hostile.yaml", config)
    argv = {"validate": ["validate", "finetune", "llm", "-c", path],
            "dry-run": ["finetune", "llm", "-c", path, "--dry-run"],
            "run": ["finetune", "llm", "-c", path],
            "export": ["export", _received_checkpoint(hostile, config), hostile / "exported"],
            "slurm": ["finetune", "llm", "-c", path, "--slurm"]}[mode]
    rc, text = s.run_main(*argv)
    assert rc == 2, text
    assert f"{hostile_cases(hostile)[case_id][2]}: " in text and "Traceback" not in text, text
    assert not s.marker(hostile).exists(), text
    assert "evilpkg" not in sys.modules
    assert not (hostile / "ckpt").exists() and not (hostile / "job.sbatch").exists()
    assert not (hostile / "exported").exists() and not (hostile / "exported.partial").exists()


def test_positive_control_the_payloads_are_live(hostile):
    """Called directly (not from a config) each gadget does create the marker: the battery is not vacuous."""
    import importlib

    for gid, node in s.gadgets(hostile):
        if gid == "load_from_disk":  # refused by name only: no payload of its own here
            continue
        s.marker(hostile).unlink(missing_ok=True)
        module, _, name = node["_target_"].rpartition(".")
        fn = getattr(importlib.import_module(module), name)
        try:
            fn(**{k: v for k, v in node.items() if k != "_target_"})
        except Exception:  # noqa: BLE001, S110 - the crafted files need not make sense after the payload ran
            pass
        assert s.marker(hostile).exists(), gid
        sys.modules.pop("evilpkg", None)
