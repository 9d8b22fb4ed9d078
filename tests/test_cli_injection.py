"""``_target_`` injection through real config files and the real CLI: refused, reported, and nothing runs."""

from __future__ import annotations

import pickle

import pytest

# (key under `hub:`, target, kwargs) — each would create the sentinel file if it were ever called.
INJECTIONS = [
    ("a", "os.system", {"command": "touch sentinel"}),
    ("b", "subprocess.run", {"args": ["touch", "sentinel"]}),
    ("c", "subprocess.Popen", {"args": ["touch", "sentinel"]}),
    ("d", "builtins.eval", {"source": "open('sentinel', 'w')"}),
    ("e", "builtins.exec", {"source": "open('sentinel', 'w')"}),
    ("f", "importlib.import_module", {"name": "amt_sentinel_mod"}),
    ("g", "pickle.loads", {"data": "PICKLE"}),
    ("h", "torch.load", {"f": "evil.pkl", "weights_only": False}),
    ("i", "torch.os.system", {"command": "touch sentinel"}),
    ("j", "torch.serialization.load", {"f": "evil.pkl", "weights_only": False}),
    ("k", "automodel.config.targets.importlib.import_module", {"name": "amt_sentinel_mod"}),
    ("l", "torch._C._something", {}),
    ("m", "torch.__builtins__", {}),
    ("n", "/tmp/x.py:f", {}),
    ("o", "./evil.py", {}),
    ("p", "torch.utils.collect_env.run", {"command": "touch sentinel"}),
]


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch sentinel",))


def _yaml_value(value) -> str:
    import json

    return json.dumps(value)


def _evil_config(cwd) -> str:
    (cwd / "evil.pkl").write_bytes(pickle.dumps(_Evil()))
    (cwd / "amt_sentinel_mod.py").write_text("open('sentinel', 'w').close()\n")
    (cwd / "evil.py").write_text("def f():\n    open('sentinel', 'w').close()\n")
    import base64

    lines = ["thing:", "  _target_: os.system", "  command: touch sentinel", "hub:"]
    for key, target, kwargs in INJECTIONS:
        lines.append(f"  {key}:")
        lines.append(f"    _target_: {_yaml_value(target)}")
        for k, v in kwargs.items():
            if v == "PICKLE":
                lines.append(f"    {k}: !!binary {base64.b64encode(pickle.dumps(_Evil())).decode()}")
            else:
                lines.append(f"    {k}: {_yaml_value(v)}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def evil(cli, write):
    return write("evil.yaml", _evil_config(cli.cwd))


def _assert_all_refused(result, cwd):
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert "Traceback" not in err
    assert "thing._target_: 'os.system' is refused" in err
    for key, target, _ in INJECTIONS:
        assert f"hub.{key}._target_: '{target}'" in err, (key, err)
    unpickling = [key for key, _, kwargs in INJECTIONS if kwargs.get("weights_only") is False]
    for key in unpickling:  # the argument is refused too, whatever the target
        assert f"hub.{key}.weights_only: false unpickles" in err, (key, err)
    assert f"({len(INJECTIONS) + 1 + len(unpickling)} problems)" in err
    assert not (cwd / "sentinel").exists()


def test_validate_refuses_every_injection_at_once(cli, dists, evil):
    result = cli("validate", "finetune", "world", "-c", evil, dists=[dists.probe, cli.cwd])
    _assert_all_refused(result, cli.cwd)


def test_running_the_route_refuses_before_building_even_with_an_allow_list(cli, dists, evil):
    """The user's AUTOMODEL_ALLOW_TARGETS naming os, subprocess, ... still unlocks none of them."""
    result = cli("finetune", "world", "-c", evil, dists=[dists.probe, cli.cwd],
                 AUTOMODEL_ALLOW_TARGETS="os,subprocess,builtins,importlib,pickle,torch.os,torch.serialization")
    _assert_all_refused(result, cli.cwd)


@pytest.mark.parametrize("target", ["os.system", "subprocess.run", "./evil.py", "torch.serialization.load"])
def test_run_refuses_an_injected_recipe(cli, write, target):
    (cli.cwd / "evil.py").write_text("open('sentinel', 'w').close()\n")
    write("r.yaml", f"recipe:\n  _target_: {target}\n  command: touch sentinel\n")
    result = cli("run", "-c", "r.yaml", AUTOMODEL_ALLOW_TARGETS="os,subprocess")
    assert result.returncode == 2
    assert "recipe._target_" in result.stderr and "Traceback" not in result.stderr
    assert not (cli.cwd / "sentinel").exists()


def test_positive_control_an_allowed_target_does_build(cli, dists, write):
    write("ok.yaml", "thing:\n  _target_: automodel_probe.targets.make_thing\n  size: 1\n  marker: sentinel\n")
    assert cli("finetune", "world", "-c", "ok.yaml", dists=[dists.probe]).returncode == 0
    assert (cli.cwd / "sentinel").exists()
