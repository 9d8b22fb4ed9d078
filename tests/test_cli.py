"""The ``automodel`` CLI end to end, in subprocesses of the installed console script."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.smoke  # the core's share of make test-min

LIGHT_COMMANDS = [["--help"], ["recipes"], ["plugins"], ["plugins", "--json"], ["cp"], ["hello", "--help"]]

NO_TORCH = """
import json, sys
from automodel.cli.main import main
report = []
for args in json.loads(sys.argv[1]):
    rc = main(args)
    heavy = sorted(m for m in ("torch", "transformers", "datasets", "peft", "numpy") if m in sys.modules)
    report.append([args, rc, heavy])
print("REPORT=" + json.dumps(report), file=sys.stderr)
"""


def test_light_commands_do_not_import_torch(cli, dists):
    result = cli.python(NO_TORCH, json.dumps(LIGHT_COMMANDS), dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stderr.split("REPORT=", 1)[1])
    assert [args for args, _, _ in report] == LIGHT_COMMANDS
    for args, rc, heavy in report:
        assert (rc, heavy) == (0, []), (args, rc, heavy)


def test_importing_the_plugin_api_imports_no_torch(cli):
    result = cli.python("import sys\nfrom automodel import hookimpl, BaseRecipe\nimport automodel.config\n"
                        "import automodel.plugins.manager\nprint('torch' in sys.modules)")
    assert result.stdout.strip() == "False", result.stderr


def test_help_import_time_has_no_torch(cli):
    """What the repository's own quick check runs: `python -X importtime automodel --help`."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "automodel.cli.main", "--help"],
                         cwd=cli.cwd, env=cli.env(), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\|\s+automodel\.plugins\.manager$", out.stderr, re.MULTILINE)  # the check can see imports
    assert not re.search(r"\|\s+torch$", out.stderr, re.MULTILINE)


def test_version(cli):
    result = cli("--version")
    assert result.returncode == 0 and "automodel" in result.stdout


def test_unknown_command_lists_available_commands(cli, dists):
    result = cli("nosuchcmd", dists=[dists.hello])
    assert result.returncode == 2
    assert "unknown command 'nosuchcmd'" in result.stderr
    available = re.search(r"available: ([^;\n]+)", result.stderr).group(1)
    assert {"cp", "hello", "plugins", "recipes", "run", "validate"} <= set(available.split(", "))
    assert "Traceback" not in result.stderr


def test_unknown_command_did_you_mean(cli):
    result = cli("recipies")
    assert result.returncode == 2 and "(did you mean 'recipes'?)" in result.stderr


def test_unknown_finetune_vlm_says_what_to_install(cli, write):
    write("x.yaml", "a: 1\n")
    # automodel-vlm may be installed in this venv: disabling it is what "not installed" looks like to the CLI
    result = cli("finetune", "vlm", "-c", "x.yaml", AUTOMODEL_DISABLE_PLUGINS="vlm")
    assert result.returncode == 2
    assert "pip install automodel-vlm" in result.stderr
    assert "Traceback" not in result.stderr


def test_route_finetune_exists_but_not_vlm(cli, dists, write):
    write("x.yaml", "a: 1\n")
    result = cli("finetune", "vlm", "-c", "x.yaml", dists=[dists.probe], AUTOMODEL_DISABLE_PLUGINS="vlm")
    assert result.returncode == 2
    assert "no recipe for 'finetune vlm'" in result.stderr
    assert re.search(r"available for 'finetune': [^;]*\bworld\b", result.stderr), result.stderr
    assert "pip install automodel-vlm" in result.stderr


def test_route_domain_typo_suggests(cli, dists, write):
    write("x.yaml", "a: 1\n")
    result = cli("hello", "wrold", "-c", "x.yaml", dists=[dists.hello])
    assert result.returncode == 2 and "(did you mean 'world'?)" in result.stderr


def test_route_needs_domain_and_config(cli, dists):
    result = cli("hello", dists=[dists.hello])
    assert result.returncode == 2 and "needs a domain: world" in result.stderr
    result = cli("finetune", "world", dists=[dists.probe])
    assert result.returncode == 2 and "needs a config" in result.stderr and "probe/base" in result.stderr


def test_missing_config_file(cli, dists):
    result = cli("hello", "world", "-c", "nope.yaml", dists=[dists.hello])
    assert result.returncode == 2 and "'nope.yaml' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


# ---- --print-config / --dry-run -------------------------------------------------------------------------

PROBE_CFG = """\
step_scheduler:
  max_steps: ${AMT_STEPS,4}
thing:
  _target_: automodel_probe.targets.make_thing
  size: 2
  marker: built.txt
hub:
  hf_token: hf_verysecret
  token: ${AMT_HF_TOKEN,anon}
  password: hunter2
  api_key: sk-123
  secret: s3
  authorization: Bearer abc
  tokenizer_name_or_path: tok/path
  pad_token_id: 0
  max_tokens: 64
"""


def test_print_config_masks_secrets_keeps_placeholders_and_builds_nothing(cli, dists, write):
    write("p.yaml", PROBE_CFG)
    result = cli("finetune", "world", "-c", "p.yaml", "--print-config", "--step_scheduler.lr", "1e-4",
                 dists=[dists.probe], AMT_HF_TOKEN="hf_fromenv")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for secret in ("hf_verysecret", "hunter2", "sk-123", "s3\n", "Bearer abc", "hf_fromenv"):
        assert secret not in out, secret
    import yaml

    printed = yaml.safe_load(out)
    hub = printed["hub"]
    assert hub["hf_token"] == hub["password"] == hub["api_key"] == hub["secret"] == hub["authorization"] == "***"
    assert hub["token"] == "${AMT_HF_TOKEN,anon}"
    assert (hub["tokenizer_name_or_path"], hub["pad_token_id"], hub["max_tokens"]) == ("tok/path", 0, 64)
    assert printed["step_scheduler"] == {"max_steps": "${AMT_STEPS,4}", "lr": 1e-4}  # override applied
    assert not (cli.cwd / "built.txt").exists()


def test_dry_run_validates_and_builds_nothing(cli, dists, write):
    write("p.yaml", PROBE_CFG)
    result = cli("finetune", "world", "-c", "p.yaml", "--dry-run", dists=[dists.probe])
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout and "automodel_probe.recipe.ProbeRecipe" in result.stdout
    assert "nothing was built" in result.stdout
    assert not (cli.cwd / "built.txt").exists() and not (cli.cwd / "probe_done.json").exists()


def test_dry_run_still_reports_config_errors(cli, dists, write):
    write("p.yaml", PROBE_CFG.replace("size: 2", "sise: 2"))
    result = cli("finetune", "world", "-c", "p.yaml", "--dry-run", dists=[dists.probe])
    assert result.returncode == 2 and "thing.sise" in result.stderr and "(did you mean 'size'?)" in result.stderr


def test_real_run_builds_what_dry_run_did_not(cli, dists, write):
    write("p.yaml", PROBE_CFG)
    result = cli("finetune", "world", "-c", "p.yaml", "--step_scheduler.max_steps=9", dists=[dists.probe],
                 AMT_STEPS="7")
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "built.txt").exists()
    assert json.loads((cli.cwd / "probe_done.json").read_text()) == \
        {"thing": {"size": 2, "color": "red"}, "max_steps": 9, "lr": 0.1}


def test_env_placeholder_typed_in_a_run(cli, dists, write):
    write("p.yaml", PROBE_CFG)
    assert cli("finetune", "world", "-c", "p.yaml", dists=[dists.probe], AMT_STEPS="7").returncode == 0
    assert json.loads((cli.cwd / "probe_done.json").read_text())["max_steps"] == 7


def test_missing_env_variable_is_a_config_error(cli, dists, write):
    write("p.yaml", "step_scheduler:\n  max_steps: ${AMT_UNSET_STEPS}\n")
    result = cli("finetune", "world", "-c", "p.yaml", dists=[dists.probe])
    assert result.returncode == 2
    assert "step_scheduler.max_steps" in result.stderr and "AMT_UNSET_STEPS" in result.stderr


# ---- overrides ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,key,suggestion", [
    (["--greeting.nam", "Bob"], "greeting.nam", "name"),
    (["--greting.name", "Bob"], "greting", "greeting"),
])
def test_unknown_override_suggests_the_right_key(cli, dists, write, args, key, suggestion):
    write("x.yaml", "greeting: {}\n")
    result = cli("hello", "earth", "-c", "x.yaml", *args, dists=[dists.hello])
    assert result.returncode == 2
    assert f"{key}:" in result.stderr and f"(did you mean '{suggestion}'?)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (cli.cwd / "hello.txt").exists()


def test_step_scheduler_override_typo(cli, dists, write):
    write("p.yaml", "thing:\n  _target_: automodel_probe.targets.make_thing\n  size: 1\n")
    result = cli("finetune", "world", "-c", "p.yaml", "--step_scheduler.max_step", "5", dists=[dists.probe])
    assert result.returncode == 2
    assert "step_scheduler.max_step" in result.stderr and "(did you mean 'max_steps'?)" in result.stderr


def test_override_type_error_and_bad_override_syntax(cli, dists, write):
    write("x.yaml", "greeting: {}\n")
    result = cli("hello", "world", "-c", "x.yaml", "--greeting.name", "[1,2]", dists=[dists.hello])
    assert result.returncode == 2 and "greeting.name: expected str, found list" in result.stderr
    result = cli("hello", "world", "-c", "x.yaml", "--greeting.name", dists=[dists.hello])
    assert result.returncode == 2 and "override has no value" in result.stderr


def test_null_override(cli, dists, write):
    write("p.yaml", PROBE_CFG)
    result = cli("finetune", "world", "-c", "p.yaml", "--thing", "null", "--step_scheduler.lr", "-1e-4",
                 "--print-config", dists=[dists.probe])
    assert result.returncode == 0, result.stderr
    import yaml

    printed = yaml.safe_load(result.stdout)
    assert printed["thing"] is None
    assert printed["step_scheduler"]["lr"] == -1e-4


# ---- cp ------------------------------------------------------------------------------------------------------

def test_cp_lists_and_copies_an_example(cli, dists):
    listing = cli("cp", dists=[dists.hello])
    assert listing.returncode == 0 and re.search(r"^hello/hi\s", listing.stdout, re.MULTILINE), listing.stdout
    result = cli("cp", "hello/hi", "mine.yaml", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "mine.yaml").read_text() == (dists.hello / "automodel_hello/examples/hi.yaml").read_text()
    again = cli("cp", "hello/hi", "mine.yaml", dists=[dists.hello])
    assert again.returncode == 2 and "already exists" in again.stderr
    assert cli("cp", "hello/hi.yaml", "mine.yaml", "--force", dists=[dists.hello]).returncode == 0
    (cli.cwd / "sub").mkdir()
    assert cli("cp", "hello/hi", "sub", dists=[dists.hello]).returncode == 0
    assert (cli.cwd / "sub" / "hi.yaml").exists()


def test_cp_unknown_example(cli, dists):
    result = cli("cp", "hello/nope", "x.yaml", dists=[dists.hello])
    assert result.returncode == 2 and "no shipped example 'hello/nope'" in result.stderr
    assert "hello/hi" in result.stderr


def test_example_name_as_config(cli, dists):
    result = cli("hello", "world", "-c", "hello/hi", dists=[dists.hello])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "hello.txt").read_text() == "hello from-example"


# ---- run / validate ------------------------------------------------------------------------------------------

RUN_CFG = "recipe:\n  _target_: automodel_hello.recipe.HelloRecipe\ngreeting:\n  name: Runner\n"


def test_run_needs_the_recipe_package_allowed(cli, dists, write):
    write("r.yaml", RUN_CFG)
    result = cli("run", "-c", "r.yaml", dists=[dists.hello])
    assert result.returncode == 2
    assert "recipe._target_" in result.stderr and "AUTOMODEL_ALLOW_TARGETS" in result.stderr
    assert not (cli.cwd / "hello.txt").exists()


def test_run_with_allow_targets(cli, dists, write):
    write("r.yaml", RUN_CFG)
    result = cli("run", "-c", "r.yaml", "--greeting.name", "Zoe", dists=[dists.hello],
                 AUTOMODEL_ALLOW_TARGETS="automodel_hello")
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "hello.txt").read_text() == "hello Zoe"


def test_run_with_plugin_allowed_targets(cli, dists, write):
    write("r.yaml", "recipe:\n  _target_: automodel_probe.recipe.ProbeRecipe\n" + PROBE_CFG)
    result = cli("run", "-c", "r.yaml", dists=[dists.probe])
    assert result.returncode == 0, result.stderr
    assert (cli.cwd / "probe_done.json").exists()


def test_run_refuses_a_non_recipe_and_a_missing_recipe_key(cli, dists, write):
    write("r.yaml", "recipe:\n  _target_: automodel_probe.targets.make_thing\n")
    result = cli("run", "-c", "r.yaml", dists=[dists.probe])
    assert result.returncode == 2 and "is not a recipe" in result.stderr
    write("n.yaml", "greeting: {}\n")
    result = cli("run", "-c", "n.yaml", dists=[dists.probe])
    assert result.returncode == 2 and "recipe: missing" in result.stderr


THREE_MISTAKES = """\
step_schedular:
  max_steps: 3
thing:
  _target_: automodel_probe.targets.make_thing
  size: 1
  colr: blue
hub:
  opt:
    _target_: torch.optim.AdamX
"""


def test_validate_reports_every_problem_at_once(cli, dists, write):
    write("bad.yaml", THREE_MISTAKES)
    result = cli("validate", "finetune", "world", "-c", "bad.yaml", dists=[dists.probe])
    assert result.returncode == 2
    err = result.stderr
    assert "(3 problems)" in err, err
    assert "step_schedular: unknown section" in err and "(did you mean 'step_scheduler'?)" in err
    assert "thing.colr:" in err and "(did you mean 'color'?)" in err
    assert "hub.opt._target_:" in err and "(did you mean 'torch.optim.AdamW'?)" in err
    assert "Traceback" not in err


def test_validate_without_route_picks_the_best_fitting_recipe(cli, dists, write):
    write("bad.yaml", "greting: {}\ngreeting:\n  nme: x\n  out: 5\n")
    result = cli("validate", "-c", "bad.yaml", dists=[dists.hello, dists.probe])
    assert result.returncode == 2
    assert "(3 problems)" in result.stderr, result.stderr
    assert "greting: unknown section for this recipe (did you mean 'greeting'?)" in result.stderr
    assert "greeting.nme: unknown key" in result.stderr and "(did you mean 'name'?)" in result.stderr
    assert "greeting.out: expected str, found int 5" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_ok(cli, dists, write):
    write("good.yaml", "thing:\n  _target_: automodel_probe.targets.make_thing\n  size: 1\n")
    result = cli("validate", "finetune", "world", "-c", "good.yaml", dists=[dists.probe])
    assert result.returncode == 0, result.stderr
    assert "valid for finetune world" in result.stdout


def test_validate_with_recipe_key_and_overrides(cli, dists, write):
    write("r.yaml", RUN_CFG)
    result = cli("validate", "-c", "r.yaml", "--greeting.nme", "x", dists=[dists.hello],
                 AUTOMODEL_ALLOW_TARGETS="automodel_hello")
    assert result.returncode == 2 and "greeting.nme" in result.stderr
    ok = cli("validate", "-c", "r.yaml", dists=[dists.hello], AUTOMODEL_ALLOW_TARGETS="automodel_hello")
    assert ok.returncode == 0 and "valid for automodel_hello.recipe.HelloRecipe" in ok.stdout


def test_validate_unknown_route(cli, dists, write):
    write("x.yaml", "greeting: {}\n")
    result = cli("validate", "hello", "mars", "-c", "x.yaml", dists=[dists.hello])
    assert result.returncode == 2 and "unknown route 'hello mars'" in result.stderr


@pytest.mark.parametrize("text,needle", [
    ("a: !!python/object/apply:os.system ['touch sentinel']\n", "!!python/object/apply:os.system"),
    ("greeting:\n\tname: x\n", "tab"),
    ("greeting: {}\ngreeting: {}\n", "duplicate key 'greeting'"),
    ("greeting: [1\n", "line 2"),
])
def test_bad_yaml_via_cli(cli, dists, write, text, needle):
    write("x.yaml", text)
    result = cli("hello", "world", "-c", "x.yaml", dists=[dists.hello])
    assert result.returncode == 2
    assert needle in result.stderr and "x.yaml" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (cli.cwd / "sentinel").exists()
