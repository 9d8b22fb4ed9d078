"""The bad-input battery: every case in tests/bad_configs/ is refused clearly, early, and without side effects.

Each ``tests/bad_configs/<name>.yaml`` is a config with one mistake and a comment header saying what must happen::

    # case: what is wrong (one line)
    # key: the dotted key (or file/flag) the message must name
    # expect: a fragment of the message (repeatable)
    # stage: validate | setup | runtime   (how far the run may get before it is refused)
    # exit: the exit code (2: a config or usage error, 1: found while building)
    # args: extra command-line arguments (overrides), optional
    # command: the command words (default: finetune llm), optional
    # config: what -c names instead of the case file, optional
    # via: subprocess   (also run through the installed console script), optional

``stage: validate`` means the recipe is never constructed (refused by validation); ``setup`` means nothing is
loaded (no tokenizer, model or data); ``runtime`` cases are data or file problems found while building. In
every case: the exit code, the key and the fragments in the message, no traceback, and nothing written to the
checkpoint directory (no ``epoch_*``, no ``LATEST``, no ``training.jsonl``). Configs use ``${AMT_BAD_CONFIGS}``
(this directory) and ``${AMT_OTHER_ARCH_CKPT}`` (a checkpoint of a wider model, made by a fixture).
The refusal wall time of each case is printed after the module's tests (no assertion on it).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import reliability_helpers as h

CASE_DIR = h.BAD_CONFIGS
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@dataclass
class Case:
    name: str
    path: Path
    description: str = ""
    key: str = ""
    expect: list[str] = field(default_factory=list)
    stage: str = "validate"
    exit: int = 2
    args: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=lambda: ["finetune", "llm"])
    config: str | None = None
    via: str = ""

    def argv(self) -> list[str]:
        return [*self.command, "-c", self.config or str(self.path), *self.args]


def load_case(path: Path) -> Case:
    case = Case(path.stem, path)
    for line in path.read_text().splitlines():
        if not line.startswith("# "):
            break
        name, _, value = line[2:].partition(": ")
        value = value.strip()
        if name == "case":
            case.description = value
        elif name == "key":
            case.key = value
        elif name == "expect":
            case.expect.append(value)
        elif name == "stage":
            case.stage = value
        elif name == "exit":
            case.exit = int(value)
        elif name == "args":
            case.args = shlex.split(value)
        elif name == "command":
            case.command = value.split()
        elif name == "config":
            case.config = value
        elif name == "via":
            case.via = value
        else:
            raise ValueError(f"{path.name}: unknown header field {name!r}")
    assert case.key and case.expect and case.stage in ("validate", "setup", "runtime"), path.name
    return case


CASES = [load_case(p) for p in sorted(CASE_DIR.glob("*.yaml"))]
TIMINGS: dict[str, tuple[str, float]] = {}


def test_the_battery_is_big_enough_and_well_formed():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)
    assert sum(c.via == "subprocess" for c in CASES) >= 3


@pytest.fixture(scope="module")
def battery_env(tmp_path_factory):
    """Environment the case files interpolate, and a checkpoint of a 48-wide model for the architecture case."""
    from automodel_llm import AutoModelForCausalLM

    ckpt = tmp_path_factory.mktemp("other_arch") / "epoch_0_step_1"
    model = AutoModelForCausalLM.from_config(str(h.write_tiny_llama(ckpt.parent / "cfg", hidden_size=48)))
    model.save_pretrained(str(ckpt / "model"))
    (ckpt / "trainer_state.json").write_text(json.dumps(
        {"format": 2, "step": 1, "epoch": 0, "losses": [], "world_size": 1, "skipped_steps": 0,
         "step_scheduler": {"step": 1, "epoch": 0, "epoch_step": 1}, "weights": "model"}))
    return {"AMT_BAD_CONFIGS": str(CASE_DIR), "AMT_OTHER_ARCH_CKPT": str(ckpt)}


@pytest.fixture(scope="module", autouse=True)
def timing_report(request):
    yield
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if reporter is None or not TIMINGS:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line("")
        reporter.write_line(f"bad-config refusal wall times ({len(TIMINGS)} runs):")
        for name, (how, seconds) in sorted(TIMINGS.items(), key=lambda kv: -kv[1][1]):
            reporter.write_line(f"  {seconds:7.3f} s  {how:10s} {name}")


def assert_nothing_written(cwd: Path, text: str) -> None:
    for pattern in ("**/epoch_*", "**/LATEST", "**/training.jsonl", "**/validation.jsonl", "**/.incomplete-*"):
        found = [str(p.relative_to(cwd)) for p in cwd.glob(pattern)]
        assert not found, f"written despite the refusal: {found}\n{text}"


def assert_refusal(case: Case, rc: int, text: str, cwd: Path) -> None:
    assert rc == case.exit, f"{case.name}: exit {rc}, expected {case.exit}\n{text}"
    assert case.key in text, f"{case.name}: the message does not name {case.key!r}\n{text}"
    for fragment in case.expect:
        assert fragment in text, f"{case.name}: {fragment!r} not in the message\n{text}"
    assert "Traceback" not in text, text
    assert_nothing_written(cwd, text)


class Progress:
    """Records how far a run got: recipe constructed, setup entered, tokenizer/model/data loaded."""

    def __init__(self, monkeypatch):
        from automodel.cli.execute import import_recipe
        from automodel.plugins.manager import get_plugin_manager
        from automodel.training import builders
        from automodel.training.recipe import TrainRecipe

        self.reached: list[str] = []
        recipe_cls = import_recipe(get_plugin_manager().routes.get("finetune", "llm").recipe)

        def record(name, fn):
            def wrapper(*args, **kwargs):
                self.reached.append(name)
                return fn(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(TrainRecipe, "setup", record("setup", TrainRecipe.setup))
        monkeypatch.setattr(recipe_cls, "setup_domain", record("tokenizer", recipe_cls.setup_domain))
        monkeypatch.setattr(builders, "build_model", record("model", builders.build_model))
        monkeypatch.setattr(TrainRecipe, "build_dataset", record("data", TrainRecipe.build_dataset))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_config_is_refused(case, battery_env, tmp_path, monkeypatch, capsys):
    from automodel.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name, value in battery_env.items():
        monkeypatch.setenv(name, value)
    for name in ("AMT_UNSET_DATA_DIR", "AUTOMODEL_DEBUG", "AUTOMODEL_ALLOW_TARGETS"):
        monkeypatch.delenv(name, raising=False)
    progress = Progress(monkeypatch)
    capsys.readouterr()
    start = time.perf_counter()
    rc = main(case.argv())
    TIMINGS[case.name] = ("in-process", time.perf_counter() - start)
    out = capsys.readouterr()
    text = out.out + out.err
    assert_refusal(case, rc, text, tmp_path)
    if case.stage == "validate":
        assert progress.reached == [], f"{case.name} is a config mistake, refused only after {progress.reached}"
    elif case.stage == "setup":
        assert progress.reached == ["setup"], f"{case.name} should be refused before loading: {progress.reached}"


def test_bad_configs_through_the_console_script(battery_env, tmp_path):
    """The cases marked ``via: subprocess`` through the installed ``automodel`` (run side by side)."""
    chosen = [c for c in CASES if c.via == "subprocess"]
    runs = []
    for case in chosen:
        cwd = tmp_path / case.name
        cwd.mkdir()
        env = h.cli_env(**battery_env)
        env.pop("AUTOMODEL_ALLOW_TARGETS", None)
        proc = subprocess.Popen(h.cli_command(*case.argv()), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        runs.append((case, cwd, proc, time.perf_counter()))
    for case, cwd, proc, start in runs:
        text, _ = proc.communicate(timeout=240)
        TIMINGS[f"{case.name} (console script)"] = ("subprocess", time.perf_counter() - start)
        assert_refusal(case, proc.returncode, text, cwd)


def test_positive_control_the_base_config_validates_and_trains(battery_env, tmp_path, monkeypatch, capsys):
    """Every case is this config with one mistake; unchanged, it validates and trains."""
    from automodel.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name, value in battery_env.items():
        monkeypatch.setenv(name, value)
    base = str(CASE_DIR / "assets" / "valid.yaml")
    assert main(["validate", "finetune", "llm", "-c", base]) == 0, capsys.readouterr().err
    assert main(["finetune", "llm", "-c", base, "--step_scheduler.max_steps", "1"]) == 0, capsys.readouterr().err
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == "epoch_0_step_1"
