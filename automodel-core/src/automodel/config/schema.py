"""Checking a config against the sections a recipe declares (the section kinds: :mod:`automodel.config.specs`)."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Literal, Union

from automodel.config.instantiate import is_callable_key, is_target_node
from automodel.config.specs import (
    ArgumentsFor,
    KeyAlias,
    Metadata,
    RecipeRef,
    Refused,
    SectionSpec,
    Target,
    apply_arguments_for,
    apply_key_aliases,
    find_spec,
)
from automodel.config.targets import TargetError, TargetResolver, is_hf_config_class
from automodel.errors import ConfigIssue
from automodel.suggest import did_you_mean


class FieldErrors(ValueError):
    """Raised by a section dataclass's ``__post_init__`` with one message per bad field, so that validation reports
    every one of them at once, each under its own dotted key."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{name}: {message}" for name, message in self.errors.items()))


def field_help(text: str, aliases: tuple[str, ...] = ()) -> dict:
    """A section field's metadata: its help line and the other names it may be written under."""
    return {"help": text, "aliases": aliases}


def require_positive(section: Any, *names: str) -> None:
    """Refuse, all at once, every named field of the dataclass instance ``section`` that is below 1 (None is fine)."""
    bad = {name: f"must be >= 1, found {getattr(section, name)}" for name in names
           if getattr(section, name) is not None and getattr(section, name) < 1}
    if bad:
        raise FieldErrors(bad)


# ---- scalar types ------------------------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return getattr(tp, "__name__", str(tp))


# The strings upstream's config loader turns into null: a section built from _target_ (`validation_dataset: none`),
# a key that may be null (`max_steps: None`)
_NONE_WORDS = ("none", "None")


def check_type(value: Any, tp: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits the annotation ``tp``, and the value converted (an int given for a float)."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if isinstance(value, str) and value in _NONE_WORDS and type(None) in args and not any(
                typing.get_origin(arg) is Literal and value in typing.get_args(arg) for arg in args):
            return True, None  # upstream's loader reads the words none / None as null (max_steps: None)
        for arg in args:
            ok, converted = check_type(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return value in typing.get_args(tp), value
    if tp is type(None) or tp is None:
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(tp)
        if args and args[-1] is not Ellipsis:
            items = [check_type(v, args[0]) for v in value]
            if not all(ok for ok, _ in items):
                return False, value
            return True, [v for _, v in items]
        return True, list(value)
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


# ---- dataclass sections ------------------------------------------------------------------------------------

def section_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints.get(f.name, Any)) for f in dataclasses.fields(cls) if f.init]


def _aliases(cls: type) -> dict[str, str]:
    return {alias: f.name for f, _ in section_fields(cls) for alias in f.metadata.get("aliases", ())}


def validate_dataclass(cls: type, node: Any, key: str, issues: list[ConfigIssue]) -> Any:
    if node is None:
        node = {}
    if not isinstance(node, dict):
        issues.append(ConfigIssue(key, f"expected a section (mapping), found {type(node).__name__} {node!r}"))
        return None
    fields = dict((f.name, (f, tp)) for f, tp in section_fields(cls))
    aliases = _aliases(cls)
    kwargs: dict[str, Any] = {}
    start = len(issues)
    if "_target_" in node:
        node = _absorb_target(cls, node, key, issues)
    upstream_only = getattr(cls, "upstream_refused", {})
    for name, value in node.items():
        canonical = aliases.get(name, name)
        if canonical not in fields and name in upstream_only:  # upstream's key: its default is what happens here
            accepted, reason = upstream_only[name]
            if value not in accepted:
                issues.append(ConfigIssue(f"{key}.{name}", f"{value!r}: {reason}"))
            continue
        if canonical not in fields:
            suggestion = did_you_mean(str(name), [*fields, *aliases])
            issues.append(ConfigIssue(f"{key}.{name}", f"unknown key; '{key}' accepts: {', '.join(fields)}",
                                      suggestion))
            continue
        if canonical in kwargs:
            issues.append(ConfigIssue(f"{key}.{name}", f"given twice (as '{canonical}' and its alias '{name}')"))
            continue
        _, tp = fields[canonical]
        ok, converted = check_type(value, tp)
        if not ok:
            issues.append(ConfigIssue(f"{key}.{name}", f"expected {_type_name(tp)}, found "
                                                       f"{type(value).__name__} {value!r}"))
            continue
        kwargs[canonical] = converted
    for name, (f, _) in fields.items():
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if missing and name not in kwargs:
            aliases = f.metadata.get("aliases", ())
            also = f" (also written {' or '.join(aliases)}): give it here or as --{key}.{name}" if aliases else ""
            issues.append(ConfigIssue(f"{key}.{name}", f"required key is missing{also}"))
    if len(issues) > start:
        return None
    try:
        return cls(**kwargs)
    except FieldErrors as err:
        issues.extend(ConfigIssue(f"{key}.{name}", message) for name, message in err.errors.items())
        return None
    except (ValueError, TypeError) as err:
        issues.append(ConfigIssue(key, str(err)))
        return None


def _absorb_target(cls: type, node: dict, key: str, issues: list[ConfigIssue]) -> dict:
    """Keyed sections may name an upstream manager class as ``_target_`` (``rng: {_target_: ...StatefulRNG}``).

    ``cls.accepted_targets`` maps the class name to the keys it implies; the target is never imported.
    """
    accepted = getattr(cls, "accepted_targets", {})
    target = node["_target_"]
    name = target.rsplit(".", 1)[-1] if isinstance(target, str) else None
    rest = {k: v for k, v in node.items() if k != "_target_"}
    if name not in accepted:
        allowed = ", ".join(accepted) or "none"
        issues.append(ConfigIssue(f"{key}._target_", f"'{target}' is not accepted here: this section is set by its "
                                                     f"keys (a _target_ may only name: {allowed})"))
        return rest
    return {**accepted[name], **rest}


# ---- target sections ---------------------------------------------------------------------------------------

def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def check_target_node(node: dict, key: str, resolver: TargetResolver, issues: list[ConfigIssue],
                      runtime_args: tuple[str, ...] = (), default_target: str | None = None) -> None:
    """Resolve the node's target and check its keyword arguments against the signature, recursively."""
    name = node.get("_target_", default_target)
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    for k, v in kwargs.items():
        check_nested(v, f"{key}.{k}", resolver, issues)
    try:
        fn = resolver.resolve(name)
    except TargetError as err:
        issues.append(ConfigIssue(f"{key}._target_" if "_target_" in node else key, str(err), err.suggestion))
        return
    _check_arguments(fn, str(name), kwargs, key, runtime_args, issues)
    _own_checks(fn, kwargs, key, issues)


def _own_checks(fn: Any, kwargs: dict, key: str, issues: list[ConfigIssue]) -> None:
    """A target may check its own keyword arguments before anything is built: its class (or the class of a
    classmethod constructor), or the function itself, has ``automodel_config_issues(kwargs) -> {argument:
    message}``; a classmethod constructor's function may have one of its own too (both are asked)."""
    owner = fn.__self__ if inspect.ismethod(fn) else fn
    checks = [getattr(owner, "automodel_config_issues", None) if isinstance(owner, type) or
              inspect.isfunction(owner) else None]
    if inspect.ismethod(fn):
        checks.append(getattr(fn.__func__, "automodel_config_issues", None))
    for check in checks:
        if callable(check):
            issues.extend(ConfigIssue(f"{key}.{name}", message) for name, message in check(kwargs).items())


# What the recipes' collate_runtime_args() give a collator class by name (see check_callable_node)
COLLATOR_RUNTIME_ARGS = ("tokenizer", "processor")


def check_callable_node(node: dict, key: str, resolver: TargetResolver, issues: list[ConfigIssue]) -> None:
    """A ``_target_`` node under a key ending in ``_fn``: its callable is passed, not called (a partial binding the
    node's other keys), so they are checked against its parameters after the first, which the caller fills (a
    collate function's batch); a class (a collator) is built once with what the recipe supplies by name (its
    ``tokenizer``, the VLM recipe's ``processor``: ``collate_runtime_args``) as upstream does, so its
    constructor's parameters are the ones checked, less those."""
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    for k, v in kwargs.items():
        check_nested(v, f"{key}.{k}", resolver, issues)
    try:
        fn = resolver.resolve(node["_target_"])
    except TargetError as err:
        issues.append(ConfigIssue(f"{key}._target_", str(err), err.suggestion))
        return
    sig = _signature(fn)
    if isinstance(fn, type) or sig is None:
        runtime: tuple[str, ...] = COLLATOR_RUNTIME_ARGS
    else:
        positional = [n for n, p in sig.parameters.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        runtime = tuple(positional[:1])
    _check_arguments(fn, str(node["_target_"]), kwargs, key, runtime, issues)
    _own_checks(fn, kwargs, key, issues)


def _check_arguments(fn: Any, name: str, kwargs: dict, key: str, runtime_args: tuple[str, ...],
                     issues: list[ConfigIssue]) -> None:
    """The config's keyword arguments against ``fn``'s signature: no unknown ones (a transformers configuration
    class takes any, like a ``model.config`` mapping), every required one given (or supplied at build time:
    ``runtime_args``), choices among a ``Literal``'s values."""
    sig = _signature(fn)
    if sig is None:
        return
    params = sig.parameters
    accepts_any = is_hf_config_class(fn) or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if not accepts_any:
        settable = [n for n in named if n not in runtime_args]
        for k in kwargs:
            if k not in named:
                issues.append(ConfigIssue(f"{key}.{k}", f"{name} does not accept an argument '{k}' "
                                                        f"(it accepts: {', '.join(settable) or 'nothing'})",
                                          did_you_mean(k, settable)))
    for n in named:
        p = params[n]
        if p.default is inspect.Parameter.empty and n not in kwargs and n not in runtime_args:
            issues.append(ConfigIssue(f"{key}.{n}", f"missing required argument '{n}' of {name}"))
    for n, tp in _choice_hints(fn).items():
        if n in kwargs and not is_target_node(kwargs[n]) and not check_type(kwargs[n], tp)[0]:
            issues.append(ConfigIssue(f"{key}.{n}", f"expected {_type_name(tp)}, found {kwargs[n]!r}"))


def _choice_hints(fn: Any) -> dict[str, Any]:
    """The parameters of ``fn`` annotated with a ``Literal`` (or an optional one): their values can be checked
    before anything is built (``on_bad_row: skp`` is refused at validation, not when the data is read)."""
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # noqa: BLE001 - annotations that do not evaluate here are simply not checked
        return {}
    return {name: tp for name, tp in hints.items()
            if typing.get_origin(tp) is Literal
            or (typing.get_origin(tp) in (Union, types.UnionType)
                and any(typing.get_origin(a) is Literal for a in typing.get_args(tp)))}


def check_nested(value: Any, key: str, resolver: TargetResolver, issues: list[ConfigIssue]) -> None:
    """Resolve every nested target node, and what every key ending in ``_fn`` names (a callable passed, not called:
    ``collate_fn: pkg.fn`` or ``collate_fn: {_target_: pkg.fn, ...}``), so that validation refuses what building
    would."""
    if is_callable_key(key) and is_target_node(value):
        check_callable_node(value, key, resolver, issues)
    elif is_target_node(value):
        check_target_node(value, key, resolver, issues)
    elif isinstance(value, str) and is_callable_key(key):
        try:
            resolver.resolve(value)
        except TargetError as err:
            issues.append(ConfigIssue(key, str(err), err.suggestion))
    elif isinstance(value, dict):
        for k, v in value.items():
            check_nested(v, f"{key}.{k}", resolver, issues)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_nested(v, f"{key}[{i}]", resolver, issues)


def check_recipe(node: Any, key: str, resolver: TargetResolver, issues: list[ConfigIssue]) -> dict | None:
    """The ``recipe`` section as ``{_target_: name}`` once its name resolves to an installed recipe (None if not)."""
    name = node.get("_target_") if isinstance(node, dict) else node
    where = f"{key}._target_" if isinstance(node, dict) else key
    if not isinstance(name, str) or not name:
        issues.append(ConfigIssue(where, f"expected a recipe name or {{_target_: pkg.Class}}, found {node!r}"))
        return None
    try:
        resolver.resolve_recipe(name)
    except TargetError as err:
        issues.append(ConfigIssue(where, str(err), err.suggestion))
        return None
    extra = [k for k in node if k != "_target_"] if isinstance(node, dict) else []
    if extra:
        issues.append(ConfigIssue(f"{key}.{extra[0]}", "the recipe section holds only the recipe's name "
                                                        "(recipe: Name or recipe: {_target_: ...}); the recipe "
                                                        "reads its settings from the other sections"))
        return None
    return {"_target_": name}


def validate_sections(data: dict, sections: dict[str, SectionSpec], resolver: TargetResolver,
                      issues: list[ConfigIssue]) -> dict[str, Any]:
    """Check every top-level section; returns the section values (dataclass instances or raw mappings)."""
    values: dict[str, Any] = {}
    known = [name.rstrip("*") for name in sections if "." not in name]
    data = apply_arguments_for(apply_key_aliases(data, sections, issues), sections, issues)
    for name, node in data.items():
        spec = find_spec(str(name), sections)
        if isinstance(spec, Metadata) or (spec is None and str(name).startswith("_")):
            values[name] = node
            continue
        if isinstance(spec, Refused):
            issues.append(ConfigIssue(str(name), spec.reason))
            continue
        if spec is None:
            issues.append(ConfigIssue(str(name), "unknown section for this recipe", did_you_mean(str(name), known)))
            continue
        if isinstance(spec, type) and dataclasses.is_dataclass(spec):
            values[name] = validate_dataclass(spec, node, str(name), issues)
        elif isinstance(spec, RecipeRef):
            values[name] = check_recipe(node, str(name), resolver, issues) if node is not None else None
        elif isinstance(spec, (KeyAlias, ArgumentsFor)):
            values[name] = node  # validated as the keys it stands for
        elif isinstance(spec, Target):
            if node is None or node in _NONE_WORDS:  # upstream's loader reads `section: none` as null
                continue
            if not isinstance(node, dict):
                issues.append(ConfigIssue(str(name), f"expected a section with _target_, found {node!r}"))
                values[name] = node
                continue
            checked = {k: v for k, v in node.items() if k not in spec.builder_args}  # the recipe checks those
            if "_target_" in node:
                check_target_node(checked, str(name), resolver, issues, spec.runtime_args)
            elif spec.plain and spec.default_target:
                check_target_node(checked, str(name), resolver, issues, spec.runtime_args, spec.default_target)
            elif not spec.plain:
                issues.append(ConfigIssue(f"{name}._target_", "missing: this section is built from a _target_ "
                                                              "(a dotted path such as pkg.module.Class)"))
            else:
                check_nested(checked, str(name), resolver, issues)
            values[name] = node
        else:
            check_nested(node, str(name), resolver, issues)
            values[name] = node
    for name, spec in sections.items():
        if name.endswith("*") or name in values:
            continue
        if isinstance(spec, Target) and spec.required and data.get(name) is None:
            issues.append(ConfigIssue(name, "required section is missing" + (f": {spec.help}" if spec.help else "")))
        elif isinstance(spec, type) and dataclasses.is_dataclass(spec) and name not in data:
            values[name] = validate_dataclass(spec, {}, name, issues)
    return values
