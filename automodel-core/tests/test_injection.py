"""``_target_`` injection: nothing that reaches the OS, runs code or unpickles ever resolves.

Each case is refused by ``TargetResolver.resolve``, by ``instantiate`` (before anything is called) and by config
validation; a sentinel file that the target would create proves that nothing ran. One positive control shows
that the sentinel does appear when an allowed target is built.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from automodel import BaseRecipe
from automodel.config import (
    Free,
    Target,
    TargetError,
    TargetResolver,
    build_config,
    instantiate,
)
from automodel.errors import ConfigError


class _Evil:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _evil_pickle(sentinel: Path) -> bytes:
    return pickle.dumps(_Evil(sentinel))


def _cases(tmp: Path) -> list[tuple[str, str, dict]]:
    """(id, target, kwargs that would create ``tmp/sentinel`` if the target were ever called)."""
    sentinel = tmp / "sentinel"
    pickled = tmp / "evil.pkl"
    pickled.write_bytes(_evil_pickle(sentinel))
    module = tmp / "amt_sentinel_mod.py"
    module.write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    evil_py = tmp / "evil.py"
    evil_py.write_text(f"def f():\n    open({str(sentinel)!r}, 'w').close()\n")
    shell = f"touch {sentinel}"
    return [
        ("os.system", "os.system", {"command": shell}),
        ("os.popen", "os.popen", {"cmd": shell}),
        ("subprocess.run", "subprocess.run", {"args": ["touch", str(sentinel)]}),
        ("subprocess.Popen", "subprocess.Popen", {"args": ["touch", str(sentinel)]}),
        ("subprocess.check_call", "subprocess.check_call", {"args": ["touch", str(sentinel)]}),
        ("builtins.eval", "builtins.eval", {"source": f"open({str(sentinel)!r}, 'w')"}),
        ("builtins.exec", "builtins.exec", {"source": f"open({str(sentinel)!r}, 'w')"}),
        ("builtins.open", "builtins.open", {"file": str(sentinel), "mode": "w"}),
        ("importlib.import_module", "importlib.import_module", {"name": "amt_sentinel_mod"}),
        ("pickle.loads", "pickle.loads", {"data": _evil_pickle(sentinel)}),
        ("pickle.load", "pickle.load", {"file": str(pickled)}),
        ("torch.load", "torch.load", {"f": str(pickled), "weights_only": False}),
        ("torch.serialization.load", "torch.serialization.load", {"f": str(pickled), "weights_only": False}),
        ("torch.os.system", "torch.os.system", {"command": shell}),  # walks through a module attribute
        ("torch.functional.torch.load", "torch.functional.torch.load", {"f": str(pickled), "weights_only": False}),
        ("torch.hub.load", "torch.hub.load", {"repo_or_dir": str(tmp), "model": "f", "source": "local"}),
        ("torch.utils.collect_env.run", "torch.utils.collect_env.run", {"command": shell}),
        ("torch.distributed.run.main", "torch.distributed.run.main", {"args": [str(evil_py)]}),
        ("torch.classes.load_library", "torch.classes.load_library", {"path": str(tmp / "evil.so")}),
        ("torch.cuda.CUDAPluggableAllocator", "torch.cuda.CUDAPluggableAllocator",
         {"path_to_so_file": str(tmp / "evil.so"), "alloc_fn_name": "a", "free_fn_name": "f"}),
        ("transformers.modeling_utils.load_state_dict", "transformers.modeling_utils.load_state_dict",
         {"checkpoint_file": str(pickled), "weights_only": False}),
        ("core-walk-importlib", "automodel.config.targets.importlib.import_module", {"name": "amt_sentinel_mod"}),
        ("core-walk-os", "automodel.config.trust.os.system", {"command": shell}),
        ("reexport-os.system", "amt_targets.system", {"command": shell}),
        ("reexport-subprocess.run", "amt_targets.run_command", {"args": ["touch", str(sentinel)]}),
        ("private", "torch._C._something", {}),
        ("private-walk", "torch._C._get_tracing_state", {}),
        ("dunder", "torch.__builtins__", {}),
        ("dunder-import", "amt_targets.__builtins__.eval", {"source": "1"}),
        ("file-path-colon", f"{evil_py}:f", {}),
        ("file-path-tmp", "/tmp/x.py:f", {}),
        ("file-path-relative", "./evil.py", {}),
        ("file-path-py", "evil.py", {}),
        ("windows-path", "C:\\evil.py", {}),
        ("not-allowed-prefix", "shutil.rmtree", {"path": str(tmp)}),
        ("sys-module", "sys.exit", {}),
        ("runpy", "runpy.run_path", {"path_name": str(evil_py)}),
        ("ctypes", "ctypes.CDLL", {"name": str(tmp / "evil.so")}),
        # the red team's gadgets inside libraries (issue 21): refused by the registry and by the deny-list
        ("transformers-run_command", "transformers.testing_utils.run_command", {"command": ["touch", str(sentinel)]}),
        ("transformers-import-file", "transformers.utils.import_utils.direct_transformers_import",
         {"path": str(tmp), "file": "amt_sentinel_mod.py"}),
        ("datapipes-unpickle", "torch.utils.data.datapipes.utils.decoder.basichandlers",
         {"extension": "pickle", "data": _evil_pickle(sentinel)}),
        ("flight-recorder-unpickle", "torch.distributed.flight_recorder.components.loader.read_dump",
         {"prefix": "evil", "filename": str(pickled)}),
        ("model-dump-unpickle", "torch.utils.model_dump.get_model_info", {"path_or_file": str(pickled)}),
        ("load_from_disk", "datasets.Dataset.load_from_disk", {"dataset_path": str(tmp)}),
        ("unregistered-library-callable", "transformers.pipeline", {"task": "text-generation"}),
    ]


def _ids():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return [c[0] for c in _cases(Path(tmp))]


IDS = _ids()


@pytest.fixture
def case_table(tmp_path, targets_dir):
    sys.path.insert(0, str(tmp_path))  # amt_sentinel_mod is importable: only the guard stops it
    yield {c[0]: c for c in _cases(tmp_path)}, tmp_path / "sentinel"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("amt_sentinel_mod", None)


@pytest.fixture
def _resolver(make_resolver):
    return lambda: make_resolver("amt_targets")


@pytest.mark.parametrize("case_id", IDS)
def test_resolver_refuses(case_table, case_id, _resolver):
    table, sentinel = case_table
    _, target, _ = table[case_id]
    with pytest.raises(TargetError) as info:
        _resolver().resolve(target)
    message = str(info.value)
    assert any(word in message for word in ("refused", "private", "file path", "not a registered target")), message
    assert not sentinel.exists()
    assert "amt_sentinel_mod" not in sys.modules


@pytest.mark.parametrize("case_id", IDS)
def test_instantiate_refuses_before_calling(case_table, case_id, _resolver):
    table, sentinel = case_table
    _, target, kwargs = table[case_id]
    with pytest.raises(ConfigError) as info:
        instantiate({"_target_": target, **kwargs}, _resolver(), "model")
    assert info.value.issues[0].key == "model._target_"
    assert not sentinel.exists()


@pytest.mark.parametrize("case_id", ["os.system", "subprocess.run", "builtins.eval", "pickle.loads",
                                     "torch.os.system", "importlib.import_module"])
def test_user_allow_list_cannot_unlock_denied_targets(case_table, case_id, monkeypatch):
    table, sentinel = case_table
    _, target, kwargs = table[case_id]
    monkeypatch.setenv("AUTOMODEL_ALLOW_TARGETS", "os,subprocess,builtins,pickle,importlib,torch.os")
    resolver = TargetResolver()
    with pytest.raises(TargetError, match="refused"):
        resolver.resolve(target)
    with pytest.raises(ConfigError):
        instantiate({"_target_": target, **kwargs}, resolver, "x")
    assert not sentinel.exists()


def test_plugin_registrations_cannot_unlock_denied_targets(make_resolver):
    with pytest.raises(TargetError, match="refused"):
        make_resolver("os", "subprocess").resolve("os.system")


def test_alias_to_a_denied_target_is_refused(case_table, make_resolver):
    _, sentinel = case_table
    resolver = make_resolver(aliases={"Run": "subprocess.run"})
    with pytest.raises(ConfigError, match="refused"):
        instantiate({"_target_": "Run", "args": ["touch", str(sentinel)]}, resolver, "x")
    assert not sentinel.exists()


def test_positive_control_sentinel_appears_for_an_allowed_target(tmp_path, targets, _resolver):
    sentinel = tmp_path / "sentinel"
    instantiate({"_target_": "amt_targets.touch", "path": str(sentinel)}, _resolver(), "x")
    assert sentinel.exists()


# ---- through config validation --------------------------------------------------------------------------

class _Recipe(BaseRecipe):
    sections: ClassVar[dict] = {"model": Target("a model"), "extra": Free("anything"), "items": Free("a list")}


VALIDATED = ["os.system", "subprocess.run", "subprocess.Popen", "builtins.exec", "importlib.import_module",
             "pickle.loads", "torch.load", "torch.os.system", "torch.serialization.load", "core-walk-importlib",
             "private", "dunder", "file-path-tmp", "file-path-relative"]


@pytest.mark.parametrize("case_id", VALIDATED)
@pytest.mark.parametrize("place", ["section", "nested", "free", "list"])
def test_config_validation_refuses(case_table, case_id, place, _resolver):
    table, sentinel = case_table
    _, target, kwargs = table[case_id]
    node = {"_target_": target, **kwargs}
    data, key = {
        "section": ({"model": node}, "model._target_"),
        "nested": ({"model": {"_target_": "amt_targets.combine", "left": node}}, "model.left._target_"),
        "free": ({"extra": {"deep": {"x": node}}}, "extra.deep.x._target_"),
        "list": ({"items": {"all": [1, node]}}, "items.all[1]._target_"),
    }[place]
    with pytest.raises(ConfigError) as info:
        build_config(data, _Recipe, _resolver())
    assert key in [issue.key for issue in info.value.issues], str(info.value)
    assert not sentinel.exists()


def test_target_from_environment_variable_is_checked_too(case_table, monkeypatch, _resolver):
    _, sentinel = case_table
    monkeypatch.setenv("AMT_EVIL", "os.system")
    with pytest.raises(ConfigError, match="refused"):
        build_config({"model": {"_target_": "${AMT_EVIL}", "command": f"touch {sentinel}"}}, _Recipe, _resolver())
    assert not sentinel.exists()


def test_recipe_key_is_checked(case_table, _resolver):
    _, sentinel = case_table
    with pytest.raises(ConfigError) as info:
        build_config({"recipe": {"_target_": "os.system", "command": f"touch {sentinel}"}}, _Recipe, _resolver())
    assert info.value.issues[0].key == "recipe._target_"
    assert not sentinel.exists()


def test_binary_pickle_in_yaml_is_inert_data(case_table, _resolver):
    """``!!binary`` is a safe tag: the bytes load as bytes and are never unpickled by the loader."""
    from automodel.config import parse_yaml

    _, sentinel = case_table
    encoded = base64.b64encode(_evil_pickle(sentinel)).decode()
    data = parse_yaml(f"extra:\n  blob: !!binary {encoded}\n")
    assert isinstance(data["extra"]["blob"], bytes)
    build_config(data, _Recipe, _resolver())
    assert not sentinel.exists()
