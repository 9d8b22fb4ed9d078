"""Safe YAML loading, scalar typing and command-line overrides (table-driven)."""

from __future__ import annotations

import pytest
import yaml

from automodel.config import (
    apply_overrides,
    dump_yaml,
    load_yaml_file,
    parse_overrides,
    parse_scalar,
    parse_yaml,
)
from automodel.errors import ConfigError

pytestmark = pytest.mark.smoke  # the core's share of make test-min

# ---- YAML text that loads -------------------------------------------------------------------------------

GOOD_YAML = [
    ("lr: 1e-4", {"lr": 1e-4}),
    ("lr: 1E-4", {"lr": 1e-4}),
    ("lr: -2e3", {"lr": -2000.0}),
    ("lr: 1.5e-3", {"lr": 1.5e-3}),
    ("lr: 3.0e+2", {"lr": 300.0}),
    ("steps: 10", {"steps": 10}),
    ("x: null", {"x": None}),
    ("x: ~", {"x": None}),
    ("flag: true", {"flag": True}),
    ("name: '1e-4'", {"name": "1e-4"}),
    ("items: [1, 2]", {"items": [1, 2]}),
    ("a:\n  b:\n    c: v", {"a": {"b": {"c": "v"}}}),
    ("a: &x {k: 1}\nb: *x", {"a": {"k": 1}, "b": {"k": 1}}),
    ("data: !!binary aGVsbG8=", {"data": b"hello"}),  # a safe standard tag
    ("p: ${HOME}", {"p": "${HOME}"}),  # placeholders are kept as text by the loader
]


@pytest.mark.parametrize("text,expected", GOOD_YAML, ids=[t for t, _ in GOOD_YAML])
def test_yaml_loads(text, expected):
    assert parse_yaml(text) == expected
    value = next(iter(expected.values()))
    assert type(next(iter(parse_yaml(text).values()))) is type(value)


# ---- YAML text that is refused, with what the message must say --------------------------------------------

BAD_YAML = [
    ("python-object", "a: !!python/object:os.system {}", ["!!python/object", "not allowed"], 1),
    ("python-apply", "a: !!python/object/apply:os.system ['touch /tmp/amt_never']",
     ["!!python/object/apply:os.system", "not allowed"], 1),
    ("python-name", "a: !!python/name:os.system ''", ["!!python/name", "not allowed"], 1),
    ("python-module", "a: !!python/module:os ''", ["not allowed"], 1),
    ("custom-tag", "a: !Evil 1", ["!Evil", "not allowed"], 1),
    ("tab-indent", "a:\n\tb: 1", ["tab"], 2),
    ("tab-in-nested", "a:\n  b:\n\t  c: 1", ["tab"], 3),
    ("duplicate-top", "a: 1\nb: 2\na: 3", ["duplicate", "'a'"], 3),
    ("duplicate-nested", "m:\n  x: 1\n  x: 2", ["duplicate", "'x'"], 3),
    ("unclosed-list", "a: [1, 2\nb: 3", ["malformed"], 2),
    ("bad-indent", "a:\n  b: 1\n c: 2", ["malformed"], 3),
    ("unclosed-quote", "a: 'oops\nb: 1\n", ["malformed"], None),
]


@pytest.mark.parametrize("text,needles,line", [c[1:] for c in BAD_YAML], ids=[c[0] for c in BAD_YAML])
def test_yaml_refused(text, needles, line):
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, source="cfg.yaml")
    message = str(info.value)
    for needle in needles:
        assert needle.lower() in message.lower(), message
    assert "cfg.yaml" in message
    if line is not None:
        assert f"line {line}" in message, message


def test_unsafe_tag_constructs_nothing(tmp_path):
    sentinel = tmp_path / "sentinel"
    with pytest.raises(ConfigError):
        parse_yaml(f"a: !!python/object/apply:os.system ['touch {sentinel}']")
    assert not sentinel.exists()


def test_loader_does_not_change_pyyaml_globally():
    parse_yaml("a: 1e-4")
    assert yaml.safe_load("a: 1e-4") == {"a": "1e-4"}  # our float fix is local to our loader


# ---- files -------------------------------------------------------------------------------------------------

FILE_CASES = [
    ("missing", None, "does not exist"),
    ("empty", "", "empty"),
    ("comment-only", "# nothing\n", "empty"),
    ("list-top", "- a\n- b\n", "must be a mapping"),
    ("scalar-top", "hello\n", "must be a mapping"),
]


@pytest.mark.parametrize("text,needle", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_load_yaml_file_errors(tmp_path, text, needle):
    path = tmp_path / "cfg.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_yaml_file(path)


def test_load_yaml_file_float_and_roundtrip(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("optimizer:\n  lr: 1e-4\n  betas: [0.9, 0.95]\n  name: ${OPT,adamw}\n")
    data = load_yaml_file(path)
    assert data == {"optimizer": {"lr": 1e-4, "betas": [0.9, 0.95], "name": "${OPT,adamw}"}}
    assert isinstance(data["optimizer"]["lr"], float)
    assert parse_yaml(dump_yaml(data)) == data


# ---- scalars typed as YAML -----------------------------------------------------------------------------------

SCALARS = [
    ("1e-4", 1e-4),
    ("5e3", 5000.0),
    ("-1e-2", -0.01),
    ("3", 3),
    ("-7", -7),
    ("0.5", 0.5),
    ("null", None),
    ("~", None),
    ("true", True),
    ("false", False),
    ("[1,2]", [1, 2]),
    ("[a, b]", ["a", "b"]),
    ("{a: 1}", {"a": 1}),
    ("hello", "hello"),
    ("'3'", "3"),
    ("", ""),
    ("a: b: c", "a: b: c"),  # not valid YAML: kept as the text
    ("${VAR,1}", "${VAR,1}"),
]


@pytest.mark.parametrize("text,expected", SCALARS, ids=[repr(t) for t, _ in SCALARS])
def test_parse_scalar(text, expected):
    value = parse_scalar(text)
    assert value == expected
    assert type(value) is type(expected)


# ---- overrides ----------------------------------------------------------------------------------------------

OVERRIDES = [
    (["--optimizer.lr", "1e-4"], [("optimizer.lr", 1e-4)]),
    (["--optimizer.lr=1e-4"], [("optimizer.lr", 1e-4)]),
    (["--x.y", "null"], [("x.y", None)]),
    (["--x.y=null"], [("x.y", None)]),
    (["--a.b", "[1,2]"], [("a.b", [1, 2])]),
    (["--a.b=v"], [("a.b", "v")]),
    (["--a.b=k=v"], [("a.b", "k=v")]),
    (["--a.b="], [("a.b", "")]),
    (["--n", "-3"], [("n", -3)]),
    (["--step_scheduler.max_steps", "500", "--rng.seed=7"], [("step_scheduler.max_steps", 500), ("rng.seed", 7)]),
    (["--model.name-or-path", "x/y"], [("model.name-or-path", "x/y")]),
    (["--a.b", "1", "--a.b", "2"], [("a.b", 1), ("a.b", 2)]),
]


@pytest.mark.parametrize("args,expected", OVERRIDES, ids=[" ".join(a) for a, _ in OVERRIDES])
def test_parse_overrides(args, expected):
    pairs = parse_overrides(args)
    assert pairs == expected
    assert [type(v) for _, v in pairs] == [type(v) for _, v in expected]


BAD_OVERRIDES = [
    (["--a.b"], ["a.b: override has no value"]),
    (["--a.b", "--c", "1"], ["a.b: override has no value"]),
    (["stray"], ["stray: unexpected argument"]),
    (["--a..b", "1"], ["a..b: not a valid dotted config key"]),
    (["--.a", "1"], ["not a valid dotted config key"]),
    (["--a.b", "--c", "1", "stray", "--1x", "2"],
     ["a.b: override has no value", "stray: unexpected", "1x: not a valid"]),
]


@pytest.mark.parametrize("args,needles", BAD_OVERRIDES, ids=[" ".join(a) for a, _ in BAD_OVERRIDES])
def test_bad_overrides_report_every_problem(args, needles):
    with pytest.raises(ConfigError) as info:
        parse_overrides(args)
    assert len(info.value.issues) == len(needles)
    message = str(info.value)
    for needle in needles:
        assert needle in message


def test_apply_overrides_creates_sections_and_leaves_input_alone():
    data = {"optimizer": {"lr": 0.1}, "model": None}
    out = apply_overrides(data, [("optimizer.lr", 1e-4), ("model.name", "m"), ("new.deep.key", [1, 2])])
    assert out == {"optimizer": {"lr": 1e-4}, "model": {"name": "m"}, "new": {"deep": {"key": [1, 2]}}}
    assert data == {"optimizer": {"lr": 0.1}, "model": None}


def test_apply_overrides_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="cannot set a key inside 'optimizer'"):
        apply_overrides({"optimizer": "adamw"}, [("optimizer.lr", 1.0)])


def test_later_override_wins():
    assert apply_overrides({}, parse_overrides(["--a.b", "1", "--a.b=2"])) == {"a": {"b": 2}}
