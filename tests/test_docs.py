"""Every snippet in docs/ works: YAML blocks validate, shell commands run, shown outputs are what automodel prints.

The conventions (also in docs/README.md, for whoever writes docs):

* ```yaml blocks are checked with ``automodel validate -c``. A block whose first line is ``# fragment`` (a
  genuinely partial snippet) is skipped; ``# file: NAME`` as the first line also writes the block to NAME in the
  doc's working directory, for the commands after it. ``# file:`` works on python and toml blocks too.
* ```bash / ```shell blocks whose first command starts with ``automodel`` (optionally after ``VAR=value``
  assignments) are run, command by command, in the doc's working directory (one fresh directory per document,
  blocks in order). A command must exit 0, unless the comment line just before it says ``# exits with code N``.
  A block starting with ``# doc-test: skip (reason)`` is not run (commands needing several GPUs, say).
* Other shell blocks are not run, except that ``[python -m] pip install ... -e DIR[extra]`` in them is emulated
  (DIR's ``src`` and a ``.dist-info`` with its ``automodel`` entry points go on ``sys.path``), so later commands
  see the plugin.
* A ```text block right after a shell block is the output of its last command: each non-empty line must appear,
  in order, in what the command printed (stdout and stderr); ``...`` inside a line matches anything.

Commands run in this process (``automodel.cli.main.main``), which keeps the whole suite fast; each gets a fresh
plugin manager so environment variables and emulated installs take effect, and (on machines without CUDA) an
address-space cap, so a snippet that asks for too much memory fails with an error instead of exhausting RAM.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_FILES = sorted(DOCS.glob("*.md"))

FENCE = re.compile(r"^```([A-Za-z]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
EXPECT_EXIT = re.compile(r"#.*\bexits? with (?:exit )?code (\d+)")
SKIP = re.compile(r"^#\s*doc-test:\s*skip\s*\((.+)\)")
FILE_MARK = re.compile(r"^#\s*file:\s*(\S+)")
SHELL, YAML, OUTPUT, FILES = ("bash", "shell", "sh"), ("yaml", "yml"), ("text", "console"), ("python", "toml")


@dataclass
class Block:
    lang: str
    body: str
    line: int
    after: str  # the text between the previous block and this one


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found, end = [], 0
    for match in FENCE.finditer(text):
        found.append(Block(match.group(1).lower(), match.group(2), text.count("\n", 0, match.start()) + 1,
                           text[end:match.start()]))
        end = match.end()
    return found


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    exit_code: int
    text: str


def commands(body: str) -> list[Command]:
    """The commands of a shell block: continuation lines joined, comments kept for `# exits with code N`."""
    out, pending, expected = [], "", 0
    for raw in body.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            match = EXPECT_EXIT.search(line)
            if match:
                expected = int(match.group(1))
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        env = {}
        while words and ASSIGNMENT.match(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        out.append(Command(words, env, expected, pending))
        pending, expected = "", 0
    return out


def output_matches(expected: str, actual: str) -> str | None:
    """None when every non-empty expected line appears in order in ``actual``; else the first missing line."""
    lines = actual.splitlines()
    index = 0
    for want in (w.strip() for w in expected.splitlines()):
        if not want:
            continue
        pattern = re.compile(".*?".join(re.escape(part) for part in want.split("...")))
        while index < len(lines) and not pattern.search(lines[index]):
            index += 1
        if index == len(lines):
            return want
        index += 1
    return None


# ---- running in this process ------------------------------------------------------------------------------

@contextlib.contextmanager
def address_space_headroom(extra_gib: float = 6.0):
    """Cap this process's address space at its current size plus ``extra_gib`` (not where CUDA is in use)."""
    try:
        import resource

        import torch
    except ImportError:
        yield
        return
    if torch.cuda.is_available() or not Path("/proc/self/status").exists():
        yield
        return
    status = Path("/proc/self/status").read_text()
    current = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + int(extra_gib * 2**30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass
class Sandbox:
    """One document's working directory, environment and emulated installs."""

    cwd: Path
    monkeypatch: pytest.MonkeyPatch
    paths: list[str] = field(default_factory=list)
    packages: set[str] = field(default_factory=set)

    def run(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        from automodel.cli.main import main
        from automodel.plugins.manager import reset_plugin_manager

        extra_paths = [str((self.cwd / p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            for path in extra_paths:
                mp.syspath_prepend(path)
            importlib.invalidate_caches()
            reset_plugin_manager(None)
            buffer = io.StringIO()
            try:
                with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), \
                        address_space_headroom():
                    code = main(argv)
            finally:
                reset_plugin_manager(None)
                for name, module in list(sys.modules.items()):  # what PYTHONPATH=... imported goes with it
                    file = getattr(module, "__file__", None) or ""
                    if extra_paths and any(file.startswith(p + os.sep) for p in extra_paths):
                        del sys.modules[name]
        return code, buffer.getvalue()

    def install_editable(self, directory: Path) -> None:
        """What `pip install -e DIR` leaves behind, without touching the shared virtualenv."""
        tomllib = pytest.importorskip("tomllib")
        project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
        name, version = project["name"], project.get("version", "0")
        site = self.cwd / ".site"
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        entry_points = project.get("entry-points", {}).get("automodel", {})
        (info / "entry_points.txt").write_text(
            "[automodel]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
        src = directory / "src" if (directory / "src").is_dir() else directory
        self.packages |= {p.name for p in src.iterdir() if p.is_dir() and not p.name.endswith(".egg-info")}
        for path in (str(site), str(src.resolve())):
            if path not in sys.path:
                self.monkeypatch.syspath_prepend(path)
                self.paths.append(path)
        importlib.invalidate_caches()

    def close(self) -> None:
        from automodel.plugins.manager import reset_plugin_manager

        for name in list(sys.modules):
            if name.split(".")[0] in self.packages:
                del sys.modules[name]
        reset_plugin_manager(None)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    for key in ("AUTOMODEL_DISABLE_PLUGINS", "AUTOMODEL_ALLOW_TARGETS", "AUTOMODEL_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(tmp_path)
    box = Sandbox(tmp_path, monkeypatch)
    yield box
    box.close()


def run_document(path: Path, box: Sandbox) -> list[str]:
    """Check every block of one document in order; returns a log of what ran (for failure messages)."""
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    where = lambda block: f"{shown}:{block.line}"  # noqa: E731
    log: list[str] = []
    last_output: tuple[str, str] | None = None  # (command text, its output) of the previous shell block
    for block in blocks(path):
        first = block.body.lstrip().splitlines()[0] if block.body.strip() else ""
        if block.lang in OUTPUT:
            if last_output is not None and not block.after.strip():
                command, output = last_output
                missing = output_matches(block.body, output)
                assert missing is None, (f"{where(block)}: `{command}` did not print the line\n  {missing}\n"
                                         f"it printed:\n{output}")
                log.append(f"{where(block)}: output checked")
            last_output = None
            continue
        last_output = None
        marked = FILE_MARK.match(first)
        if marked and block.lang in (*YAML, *FILES):
            target = box.cwd / marked.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.body)
        if block.lang in YAML:
            if re.match(r"^#\s*fragment\b", first):
                log.append(f"{where(block)}: fragment, skipped")
                continue
            name = marked.group(1) if marked else f".snippet-{block.line}.yaml"
            if not marked:
                (box.cwd / name).write_text(block.body)
            code, output = box.run(["validate", "-c", name], {})
            assert code == 0, f"{where(block)}: this YAML does not validate:\n{output}"
            log.append(f"{where(block)}: {output.strip().splitlines()[-1]}")
        elif block.lang in SHELL:
            skip = SKIP.match(first)
            if skip:
                log.append(f"{where(block)}: skipped ({skip.group(1)})")
                continue
            cmds = commands(block.body)
            if not cmds:
                continue
            if cmds[0].argv[:1] != ["automodel"]:
                for cmd in cmds:  # not run; `[python -m] pip install -e DIR[extra]` is emulated for the blocks after it
                    argv = cmd.argv[2:] if cmd.argv[:3] == ["python", "-m", "pip"] else cmd.argv
                    if argv[:2] == ["pip", "install"] and "-e" in argv:
                        target = argv[argv.index("-e") + 1].split("[")[0]
                        box.install_editable((box.cwd / target).resolve())
                        log.append(f"{where(block)}: emulated pip install -e {target}")
                continue
            for cmd in cmds:
                assert cmd.argv[:1] == ["automodel"], (
                    f"{where(block)}: a block that starts with automodel may hold only automodel commands: "
                    f"{cmd.text}")
                code, output = box.run(cmd.argv[1:], cmd.env)
                assert code == cmd.exit_code, (f"{where(block)}: `{cmd.text}` exited {code}, expected "
                                               f"{cmd.exit_code}:\n{output}")
                log.append(f"{where(block)}: `{cmd.text}` -> {code}")
                last_output = (cmd.text, output)
    return log


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_document_snippets_work(path, sandbox):
    log = run_document(path, sandbox)
    print("\n".join(log))


# ---- the harness itself can fail -------------------------------------------------------------------------

def test_docs_exist_and_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in ("recipe-development.md", "targets.md", "validation-and-checkpointing.md", "config-reference.md",
                 "plugin-authoring.md", "troubleshooting.md"):
        assert (DOCS / name).is_file(), name
        assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"


def test_harness_rejects_a_bad_snippet(tmp_path, sandbox):
    doc = tmp_path / "bad.md"
    doc.write_text("```yaml\noptimizer:\n  _target_: torch.optim.AdamWW\n```\n")
    with pytest.raises(AssertionError, match="does not validate"):
        run_document(doc, sandbox)


def test_harness_checks_exit_codes_and_outputs(tmp_path, sandbox):
    doc = tmp_path / "cmds.md"
    doc.write_text("```bash\nautomodel recipes\n```\n```text\nfinetune llm ...FinetuneRecipeForNextTokenPrediction\n"
                   "```\n\n```bash\n# exits with code 2\nautomodel frobnicate\n```\n"
                   "```text\nerror: unknown command 'frobnicate'\n```\n")
    log = run_document(doc, sandbox)
    assert sum("output checked" in line for line in log) == 2
    doc.write_text("```bash\nautomodel frobnicate\n```\n")
    with pytest.raises(AssertionError, match="exited 2, expected 0"):
        run_document(doc, sandbox)
    doc.write_text("```bash\nautomodel recipes\n```\n```text\nthis line is not printed\n```\n")
    with pytest.raises(AssertionError, match="did not print the line"):
        run_document(doc, sandbox)


def test_command_parsing():
    cmds = commands("# comment\nAUTOMODEL_ALLOW_TARGETS=mypkg automodel validate \\\n  -c x.yaml  # trailing\n"
                    "# exits with code 2: the override is wrong\nautomodel validate -c x.yaml --a.b 1\n")
    assert [c.argv for c in cmds] == [["automodel", "validate", "-c", "x.yaml"],
                                      ["automodel", "validate", "-c", "x.yaml", "--a.b", "1"]]
    assert cmds[0].env == {"AUTOMODEL_ALLOW_TARGETS": "mypkg"} and cmds[0].exit_code == 0
    assert cmds[1].exit_code == 2
    assert output_matches("a ... c\nd", "x a b c y\nz\nd") is None
    assert output_matches("d\na", "a\nd") == "a"


# ---- plugin-authoring.md against the code ------------------------------------------------------------------

def _normalized(text: str) -> str:
    return re.sub(r"\s+", "", text).replace('"', "'")


def _signatures(path: Path, classes: bool) -> dict[str, str]:
    import ast

    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if not classes and isinstance(node, ast.FunctionDef) and node.name.startswith("automodel_"):
            found[node.name] = f"{node.name}({ast.unparse(node.args)}) -> {ast.unparse(node.returns)}"
        if classes and isinstance(node, ast.ClassDef) and node.name.endswith("Registry"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    args = ast.unparse(item.args).removeprefix("self, ").removeprefix("self")
                    found[f"{node.name}.{item.name}"] = f"{item.name}({args}) -> {ast.unparse(item.returns)}"
    return found


def test_plugin_authoring_documents_every_hook_with_its_exact_signature():
    import automodel.plugins.hookspecs as hookspecs

    doc = (DOCS / "plugin-authoring.md").read_text()
    hooks = _signatures(Path(hookspecs.__file__), classes=False)
    assert len(hooks) == 7, sorted(hooks)
    for signature in hooks.values():
        assert _normalized(signature) in _normalized(doc), f"plugin-authoring.md lacks `{signature}`"
    mentioned = set(re.findall(r"\bautomodel_(?:register_\w+|allowed_targets)\b", doc))
    assert mentioned <= set(hooks), f"documented hooks that do not exist: {sorted(mentioned - set(hooks))}"


def test_plugin_authoring_documents_every_registry_method():
    import automodel.plugins.registries as registries

    doc = _normalized((DOCS / "plugin-authoring.md").read_text())
    methods = _signatures(Path(registries.__file__), classes=True)
    assert {"RouteRegistry.add", "AliasRegistry.target", "StageRegistry.add", "LoggerRegistry.get"} <= set(methods)
    for name, signature in methods.items():
        assert _normalized(signature) in doc, f"plugin-authoring.md lacks {name}: `{signature}`"
    from automodel.training.pipeline import PIPELINE_SLOTS

    for slot in PIPELINE_SLOTS:
        assert f"`{slot}`" in (DOCS / "plugin-authoring.md").read_text(), slot


def test_plugin_authoring_example_tests_pass(sandbox):
    """The doc's hello plugin, written out by its `# file:` blocks, passes the doc's own plugin tests."""
    import subprocess

    run_document(DOCS / "plugin-authoring.md", sandbox)
    tests = sandbox.cwd / "automodel-hello" / "tests"
    assert (tests / "test_hello.py").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOMODEL_")}
    env["PYTHONPATH"] = str(sandbox.cwd / "automodel-hello" / "src")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                            cwd=sandbox.cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout
