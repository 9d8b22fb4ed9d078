"""The red team's gadgets (issue 21), each armed: the files it needs are written into a directory, and calling it
would create ``<dir>/marker``. tests/test_security_*.py place them in configs and check that nothing ever runs.

Tests import it by name: pytest.ini puts tests/ on the path.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any


class Touch:
    """Unpickling this runs ``touch <path>``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def run_main(*argv: Any) -> tuple[int, str]:
    """``automodel <argv>`` in this process: (exit code, stdout + stderr)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from automodel.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue() + err.getvalue()


def marker(directory: Path) -> Path:
    return Path(directory) / "marker"


def evil_pickle(directory: Path) -> bytes:
    return pickle.dumps(Touch(marker(directory)))


def write_evil_package(directory: Path, name: str = "evilpkg") -> Path:
    """A package whose import creates the marker."""
    package = Path(directory) / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f"open({str(marker(directory))!r}, 'w').close()\n")
    (package / "sub.py").write_text("")
    return package


def write_model_dump_zip(directory: Path) -> Path:
    """A TorchScript-looking zip whose code debug info is a pickle (``get_model_info`` unpickles it)."""
    path = Path(directory) / "model.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("m/version", "3")
        zf.writestr("m/data.pkl", pickle.dumps({"a": 1}))
        zf.writestr("m/constants.pkl", pickle.dumps(()))
        zf.writestr("m/code/x.py", "pass\n")
        zf.writestr("m/code/x.py.debug_pkl", evil_pickle(directory))
    return path


def write_flight_recorder_dump(directory: Path) -> Path:
    path = Path(directory) / "rank0"
    path.write_bytes(evil_pickle(directory))
    return path


def write_remote_code_model(directory: Path) -> Path:
    """A local model directory whose config class is its own Python file (``auto_map``): importing it makes the
    marker. transformers imports it only with ``trust_remote_code=True``."""
    model = Path(directory) / "remote_model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "configuration_evil.py").write_text(
        f"open({str(marker(directory))!r}, 'w').close()\n"
        "from transformers import LlamaConfig\n\n\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    (model / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"},
        "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2}))
    return model


def gadgets(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """(id, a target node) for every red-team gadget, its files written under ``directory``."""
    directory = Path(directory)
    write_evil_package(directory)
    return [
        ("run_command", {"_target_": "transformers.testing_utils.run_command",
                         "command": ["touch", str(marker(directory))]}),
        ("direct_transformers_import", {"_target_": "transformers.utils.import_utils.direct_transformers_import",
                                        "path": str(directory / "evilpkg")}),
        ("basichandlers-pickle", {"_target_": "torch.utils.data.datapipes.utils.decoder.basichandlers",
                                  "extension": "pickle", "data": evil_pickle(directory)}),  # !!binary in YAML
        ("model_dump", {"_target_": "torch.utils.model_dump.get_model_info",
                        "path_or_file": str(write_model_dump_zip(directory))}),
        ("flight_recorder", {"_target_": "torch.distributed.flight_recorder.components.loader.read_dump",
                             "prefix": "rank", "filename": str(write_flight_recorder_dump(directory))}),
        ("load_from_disk", {"_target_": "datasets.Dataset.load_from_disk", "dataset_path": str(directory)}),
        # the core's own package: a nested CLI invocation, and a test helper that writes files
        ("automodel-cli", {"_target_": "automodel.cli.main.main",
                           "argv": ["cp", "llm/tiny_squad", str(marker(directory))]}),
        ("automodel-write_dist", {"_target_": "automodel.testing.write_dist", "root": str(directory), "dist": "evil",
                                  "version": "1", "entry_points": {}, "files": {marker(directory).name: ""}}),
    ]


GADGET_IDS = ["run_command", "direct_transformers_import", "basichandlers-pickle", "model_dump", "flight_recorder",
              "load_from_disk", "automodel-cli", "automodel-write_dist"]
