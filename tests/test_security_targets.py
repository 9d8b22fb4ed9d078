"""Targets by registration (issue 21): the red team's gadgets inside torch / transformers / datasets never resolve,
a plugin registers exact callables or its own package only, the person running trusts their own code by flag,
environment or file, and `automodel targets` / docs/targets.md show the registry.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import reliability_helpers as h
import security_helpers as s
import yaml

from automodel.testing import write_yaml

ROOT = Path(__file__).resolve().parent.parent
# What a user might think unlocks the libraries: it must unlock none of the gadgets (the deny-list stands).
LIBRARIES = "torch,transformers,datasets,automodel"


@pytest.fixture
def armed(cwd):
    """cwd holding every gadget's files."""
    yield {gid: node for gid, node in s.gadgets(cwd)}, cwd
    sys.modules.pop("evilpkg", None)


def _config(cwd: Path, **sections) -> Path:
    config = h.run_config(h.write_tiny_llama(cwd / "model"), step_scheduler={"max_steps": 1})
    config.update(sections)
    return write_yaml(cwd / "cfg.yaml", config)  # bytes become !!binary


# ---- the red team's gadgets --------------------------------------------------------------------------------

@pytest.mark.parametrize("gid", s.GADGET_IDS)
@pytest.mark.parametrize("place", ["optimizer", "model.config", "dataset.seed", "ci.deep"])
def test_gadget_is_refused_at_validation(armed, gid, place):
    gadgets, cwd = armed
    config = yaml.safe_load(_config(cwd).read_text())
    node, parts = config, place.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = copy.deepcopy(gadgets[gid])
    path = write_yaml(cwd / "cfg.yaml", config)
    rc, text = s.run_main("validate", "finetune", "llm", "-c", path)
    assert rc == 2, text
    assert f"{place}._target_: '{gadgets[gid]['_target_']}' is " in text, text
    assert "Traceback" not in text
    assert not s.marker(cwd).exists()


@pytest.mark.parametrize("gid", s.GADGET_IDS)
def test_trusting_the_whole_library_does_not_unlock_a_gadget(armed, gid, monkeypatch):
    gadgets, cwd = armed
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", LIBRARIES)
    path = _config(cwd, optimizer=gadgets[gid])
    rc, text = s.run_main("finetune", "llm", "-c", path, "--allow-target", "transformers")
    assert rc == 2 and "optimizer._target_" in text and "refused" in text, text
    assert not s.marker(cwd).exists()


def test_pickle_in_the_yaml_is_bytes_and_never_unpickled(armed):
    gadgets, cwd = armed
    path = _config(cwd, optimizer=gadgets["basichandlers-pickle"])
    assert "!!binary" in path.read_text()
    for argv in (["validate", "finetune", "llm"], ["finetune", "llm", "--dry-run"], ["finetune", "llm"]):
        rc, text = s.run_main(*argv, "-c", path)
        assert rc == 2, text  # before: the run exited 0 after unpickling
    assert not s.marker(cwd).exists()


def test_dotted_collate_fn_strings_are_checked_at_validation(armed):
    _, cwd = armed
    path = _config(cwd, dataloader={"batch_size": 4, "collate_fn": "transformers.testing_utils.run_command"},
                   ci={"nested": {"deep": {"post_tokenize_hook_fn": "torch.utils.model_dump.get_model_info"}}})
    rc, text = s.run_main("validate", "finetune", "llm", "-c", path)
    assert rc == 2 and "(2 problems)" in text, text
    assert "dataloader.collate_fn: 'transformers.testing_utils.run_command' is refused" in text
    assert "ci.nested.deep.post_tokenize_hook_fn: 'torch.utils.model_dump.get_model_info' is refused" in text


@pytest.mark.parametrize("name", ["transformers.pipeline", "torch.optim.Optimizer.load_state_dict",
                                  "transformers.AutoTokenizer.register", "transformers.AutoConfig.register",
                                  "torch.utils.data.DataLoader.load_state_dict", "peft.PeftModel.from_pretrained",
                                  "datasets.load_dataset", "safetensors.torch.load_file"])
def test_library_callables_nobody_registered_are_refused(name):
    from automodel.config import TargetError
    from automodel.plugins.manager import PluginManager

    with pytest.raises(TargetError, match="is not a registered target"):
        PluginManager().resolver().resolve(name)


@pytest.mark.parametrize("name", [
    "transformers.AutoTokenizer.from_pretrained", "transformers.AutoConfig.from_pretrained",
    "transformers.AutoProcessor.from_pretrained", "transformers.AutoConfig.for_model", "peft.LoraConfig",
    "torch.nn.CrossEntropyLoss", "torch.utils.data.default_collate", "torchdata.stateful_dataloader.StatefulDataLoader",
    "torch.optim.lr_scheduler.OneCycleLR", "nemo_automodel.schedulers.CosineAnnealingWarmup"])
def test_registered_callables_and_class_constructors_resolve(name):
    from automodel.plugins.manager import PluginManager

    assert callable(PluginManager().resolver().resolve(name))


def test_every_registered_exact_name_resolves():
    """No registration is a typo: each exact name imports and is callable (a class or a function)."""
    from automodel.plugins.manager import PluginManager

    manager = PluginManager()
    resolver = manager.resolver()
    exact = [r.name for r in manager.targets.entries() if r.kind == "exact"]
    assert len(exact) > 50
    for name in exact:
        assert callable(resolver.resolve(name)), name


# ---- plugins register exact callables or their own package ------------------------------------------------

PLUGIN = '''\
from automodel import hookimpl

@hookimpl
def automodel_allowed_targets():
    return ["amt_owned", "torch", "transformers.testing_utils.run_command", "torch.optim.SGD", "os.system"]
'''


def _dist(root: Path, top_level: bool) -> Path:
    files = {"amt_owned/__init__.py": "def make(size: int = 1):\n    return size\n", "amt_owned/plugin.py": PLUGIN}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    info = root / "amt_owned-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: amt-owned\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[automodel]\nowned = amt_owned.plugin\n")
    if top_level:
        (info / "top_level.txt").write_text("amt_owned\n")
    return root


@pytest.mark.parametrize("top_level", [True, False], ids=["top_level.txt", "entry-point-module"])
def test_a_plugin_may_register_only_its_own_package_by_prefix(cli, tmp_path, top_level):
    site = _dist(tmp_path / "site", top_level)
    result = cli("plugins", "--json", dists=[site])
    info = next(p for p in result.json() if p["name"] == "owned")
    error = info["hook_errors"]["automodel_allowed_targets"]
    assert "'torch' is not a package of amt-owned (its packages: amt_owned)" in error, error
    assert "'transformers.testing_utils.run_command' is refused always" in error
    assert "'os.system' is refused always" in error
    targets = cli("targets", "--json", dists=[site]).json()["targets"]
    mine = {(t["name"], t["kind"]) for t in targets if "amt-owned" in t["sources"]}
    assert mine == {("amt_owned", "prefix"), ("torch.optim.SGD", "exact")}
    code = ("from automodel.plugins.manager import PluginManager\n"
            "r = PluginManager().resolver()\n"
            "print(r.resolve('amt_owned.make')(size=3))\n"
            "for name in ('torch.load', 'torch.optim.Adam', 'transformers.testing_utils.run_command'):\n"
            "    try:\n        r.resolve(name)\n    except Exception as e:\n        print(e)\n")
    out = cli.python(code, dists=[site])
    lines = out.stdout.splitlines()
    assert lines[0] == "3", out.stderr
    assert "refused" in lines[1] and "'torch.optim.Adam'" not in out.stdout and "refused" in lines[2], lines
    listed = cli("plugins", dists=[site])
    assert "error in automodel_allowed_targets: " in listed.stdout and "'torch' is not a package" in listed.stdout


# ---- the person running trusts their own code -------------------------------------------------------------

OWN = "def sgd_nesterov(params, lr: float, momentum: float = 0.9):\n    import torch\n\n" \
      "    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)\n" \
      "from subprocess import run\n"


@pytest.fixture
def own_code(tmp_path, monkeypatch):
    (tmp_path / "amt_own").mkdir()
    (tmp_path / "amt_own" / "__init__.py").write_text(OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield _config(tmp_path, optimizer={"_target_": "amt_own.sgd_nesterov", "lr": 0.01})
    sys.modules.pop("amt_own", None)


def test_own_code_is_refused_until_trusted(own_code):
    rc, text = s.run_main("validate", "finetune", "llm", "-c", own_code)
    assert rc == 2 and "'amt_own.sgd_nesterov' is not a registered target" in text, text
    for hint in ("--allow-target amt_own.sgd_nesterov", "AUTOMODEL_ALLOW_TARGETS=amt_own.sgd_nesterov",
                 "trusted-targets.txt"):
        assert hint in text


@pytest.mark.parametrize("how", ["flag", "flag-exact", "environment", "file"])
def test_own_code_trusted_by_flag_environment_or_file(own_code, how, monkeypatch, tmp_path):
    argv = ["validate", "finetune", "llm", "-c", own_code]
    if how == "flag":
        argv += ["--allow-target", "amt_other", "--allow-target", "amt_own"]
    elif how == "flag-exact":
        argv += ["--allow-target", "amt_own.sgd_nesterov"]
    elif how == "environment":
        monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", "amt_other, amt_own")
    else:
        file = tmp_path / "xdg-config" / "automodel" / "trusted-targets.txt"
        file.parent.mkdir(parents=True)
        file.write_text("# mine\namt_other\namt_own   # my optimizers\n")
    rc, text = s.run_main(*argv)
    assert rc == 0, text
    # a trusted package's re-export of a denied callable still never resolves, even with its module trusted
    rc, text = s.run_main(*argv, "--optimizer._target_", "amt_own.run", "--allow-target", "subprocess")
    refusal = "'amt_own.run' is not a registered target" if how == "flag-exact" else "'amt_own.run' is refused"
    assert rc == 2 and refusal in text, text


def test_the_flag_is_per_invocation(own_code):
    assert s.run_main("validate", "finetune", "llm", "-c", own_code, "--allow-target", "amt_own")[0] == 0
    assert s.run_main("validate", "finetune", "llm", "-c", own_code)[0] == 2


def test_trust_options_reach_torchrun_ranks_and_sbatch_scripts():
    from automodel.cli.launch import torchrun_command
    from automodel.cli.slurm import sbatch_script
    from automodel.training.sections import SlurmConfig

    argv = ["finetune", "llm", "-c", "x.yaml", "--nproc-per-node", "2", "--allow-target", "amt_own",
            "--trust-remote-code", "--optimizer.lr", "0.1"]
    command = torchrun_command({"nproc_per_node": 2}, argv)
    tail = command[command.index("automodel.cli.main") + 1:]
    assert tail == ["finetune", "llm", "-c", "x.yaml", "--allow-target", "amt_own", "--trust-remote-code",
                    "--optimizer.lr", "0.1"]
    script = sbatch_script(SlurmConfig(), [*argv, "--slurm"])
    assert "--allow-target amt_own --trust-remote-code" in script


def test_the_flag_reaches_every_torchrun_rank(own_code, tmp_path):
    """A real two-process run: each rank re-parses the command line and trusts the same package."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = h.cli_env(PYTHONPATH=str(tmp_path), AUTOMODEL_ALLOW_TARGETS="", OMP_NUM_THREADS="1")
    result = subprocess.run(h.cli_command("finetune", "llm", "-c", own_code, "--nproc-per-node", "2",
                                          "--master-port", port, "--allow-target", "amt_own"),
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "LATEST").is_file()


def test_run_command_and_export_take_the_trust_options(own_code, tmp_path):
    config = yaml.safe_load(own_code.read_text())
    config["recipe"] = {"_target_": "automodel_llm.recipe.FinetuneRecipeForNextTokenPrediction"}
    path = write_yaml(tmp_path / "run.yaml", config)
    rc, text = s.run_main("run", "-c", path, "--dry-run")
    assert rc == 2 and "amt_own.sgd_nesterov" in text
    rc, text = s.run_main("run", "-c", path, "--dry-run", "--allow-target", "amt_own")
    assert rc == 0, text
    rc, text = s.run_main("export", "--help")
    assert "--allow-target" in text and "--trust-remote-code" in text


# ---- listing the registry ------------------------------------------------------------------------------------

def test_targets_lists_the_registry_without_importing_torch(cli):
    result = cli("targets", "--json", AUTOMODEL_ALLOW_TARGETS="amt_mine")
    assert result.returncode == 0, result.stderr
    data = result.json()
    rows = {(t["name"], t["kind"]): t["sources"] for t in data["targets"]}
    assert rows[("automodel.optim", "prefix")] == ["automodel-core"]
    assert ("automodel", "prefix") not in rows  # never the whole core package (its CLI, its test helpers)
    assert rows[("torch.optim.AdamW", "exact")] == ["automodel-core"]
    rule = "transformers.models.<model>.configuration_<model>.<Name>Config"  # its configuration classes only
    assert rows[(rule, "rule")] == ["automodel-core"]
    assert rows[("automodel_llm", "prefix")] == ["automodel-llm"]
    assert sorted(rows[("peft.LoraConfig", "exact")]) == ["automodel-diffusion", "automodel-llm", "automodel-vlm"]
    assert not any(kind == "prefix" and name.split(".")[0] in ("torch", "transformers", "datasets", "diffusers", "peft")
                   for name, kind in rows)
    assert {"name": "amt_mine", "kind": "prefix", "source": "AUTOMODEL_ALLOW_TARGETS"} in data["trusted"]
    aliases = {a["alias"]: (a["target"], a["source"]) for a in data["aliases"]}
    assert aliases["nemo_automodel.datasets.squad.SquadDataset"] == ("automodel_llm.datasets.SquadDataset",
                                                                     "automodel-llm")
    text = cli("targets", "--allow-target", "amt_flag")
    assert "amt_flag" in text.stdout and "--allow-target" in text.stdout and "aliases:" in text.stdout
    assert "rule: transformers' own configuration classes" in text.stdout
    probe = cli.python("import sys\nfrom automodel.cli.main import main\nmain(['targets'])\n"
                       "print('TORCH', 'torch' in sys.modules, 'transformers' in sys.modules)")
    assert "TORCH False False" in probe.stdout, probe.stderr


def test_docs_registry_section_is_current():
    script = ROOT / "scripts" / "gen_targets_reference.py"
    spec = importlib.util.spec_from_file_location("gen_targets_reference", script)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    doc = (ROOT / "docs" / "targets.md").read_text(encoding="utf-8")
    assert generator.updated(doc, generator.render_section()) == doc, \
        "docs/targets.md is stale: run .venv/bin/python scripts/gen_targets_reference.py"
    assert "`transformers.AutoTokenizer`" in doc and "| `SquadDataset` |" in doc


# ---- what used to validate still does (the seed and upstream configs: automodel-llm's test_seed_config.py and
# test_upstream_configs.py) ----------------------------------------------------------------------------------

def _shipped_examples() -> list[Path]:
    return sorted(ROOT.glob("automodel-*/src/*/examples/*.yaml"))


@pytest.mark.parametrize("example", _shipped_examples(), ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_every_shipped_example_validates(example, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rc, text = s.run_main("validate", "-c", example)
    assert rc == 0, text


def test_bad_configs_assets_valid_config_validates(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMT_BAD_CONFIGS", str(ROOT / "tests" / "bad_configs"))
    rc, text = s.run_main("validate", "finetune", "llm", "-c", ROOT / "tests" / "bad_configs" / "assets" / "valid.yaml")
    assert rc == 0, text
