"""Generate docs/config-reference.md from the installed recipes' declared sections.

    .venv/bin/python scripts/gen_config_reference.py           # rewrite docs/config-reference.md
    .venv/bin/python scripts/gen_config_reference.py --check   # exit 1 when the committed file is stale

Every section of every installed route's recipe, with each key's type, default and help, comes from the code:
dataclass sections from their fields (``field(metadata={"help": ..., "aliases": (...)})``), ``Target`` and
``Free`` sections from their ``help``. tests/test_docs_reference.py regenerates the file and fails when the
committed one disagrees, so a changed section or a newly installed domain means re-running this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "config-reference.md"


# ---- formatting ---------------------------------------------------------------------------------------------

def type_name(tp: Any) -> str:
    if tp is Any:
        return "any"
    if tp is type(None) or tp is None:
        return "null"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{name}[{inner}]" if inner else name
    return getattr(tp, "__name__", str(tp))


def scalar(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


# ---- sections -----------------------------------------------------------------------------------------------

def describe_dataclass(name: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = [f"### `{name}`", "", f"Keyed section (`{qualname(cls)}`).", ""]
    accepted = getattr(cls, "accepted_targets", None)
    if accepted:
        lines += [f"A `_target_` naming one of {', '.join(f'`{k}`' for k in accepted)} (upstream manager classes) "
                  "is accepted and implies the keys it stands for.", ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = scalar(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = scalar(f.default_factory())
        else:
            default = "required"
        help_text = f.metadata.get("help", "")
        aliases = f.metadata.get("aliases", ())
        if aliases:
            help_text += f" (also accepted as {', '.join(f'`{a}`' for a in aliases)})"
        lines.append(f"| `{f.name}` | {type_name(hints.get(f.name, Any))} | {default} | {cell(help_text)} |")
    by_reason: dict[tuple[str, str], list[str]] = {}  # keys of the same accepted values and reason, together
    for key, (accepted, reason) in getattr(cls, "upstream_refused", {}).items():
        values = ", ".join(scalar(value) for value in accepted)
        by_reason.setdefault((values, reason), []).append(f"`{key}`")
    if by_reason:
        lines += ["", "Upstream's keys that choose nothing here, accepted at the values that are what happens and "
                  "refused at any other with the reason: " + "; ".join(
                      f"{', '.join(keys)} (accepted: {values}): {reason}"
                      for (values, reason), keys in by_reason.items()) + "."]
    return lines + [""]


def describe_target(name: str, spec: Any) -> list[str]:
    flags = ["required"] if spec.required else ["optional"]
    lines = [f"### `{name}`", ""]
    text = f"Target section ({', '.join(flags)}): {(spec.help or 'built from its `_target_`').rstrip('.')}."
    if spec.plain and spec.default_target:
        text += (f" `_target_` may be left out: the keys are then keyword arguments of `{spec.default_target}`"
                 f"{default_target_keys(spec.default_target, spec.runtime_args)}.")
    elif spec.plain:
        text += " It may be a plain mapping without `_target_`."
    else:
        text += " Its keys are the keyword arguments of the callable named by `_target_`, checked against its " \
                "signature."
    if spec.runtime_args:
        supplied = ", ".join(f"`{a}`" for a in spec.runtime_args)
        text += f" Supplied by the recipe at build time, not the YAML: {supplied}."
    for arg, what in spec.builder_args.items():
        text += f" `{arg}` is read by the section's builder, not the callable: {what.rstrip('.')}."
    if spec.documented_targets:
        text += " Usually built from one of: " + ", ".join(
            f"[`{t.rsplit('.', 1)[-1]}`](#{anchor(t)})" for t in spec.documented_targets) + "."
    if spec.default:
        text += " When absent: `{" + ", ".join(f"{k}: {v}" for k, v in spec.default.items()) + "}`."
    elif spec.default is not None:
        text += f" When absent: `{spec.default_target}` with its defaults."
    return lines + [text, ""]


def default_target_keys(dotted: str, runtime_args: tuple[str, ...]) -> str:
    """': a (default), b, ...' for the keyword arguments of a plain section's default target."""
    import inspect

    from automodel.plugins.manager import get_plugin_manager

    try:
        params = inspect.signature(get_plugin_manager().resolver().resolve(dotted)).parameters
    except Exception:  # noqa: BLE001 - the reference still names the target
        return ""
    keys = []
    for name, param in params.items():
        if name in runtime_args or name in ("self", "cls"):
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            keys.append("any other keyword")
        elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            default = "" if param.default is inspect.Parameter.empty else f" = {scalar(param.default)}"
            keys.append(f"`{name}`{default}")
    return (": " + ", ".join(keys)) if keys else ""


def documented_targets(specs: list[Any]) -> dict[str, tuple[str, ...]]:
    """dotted path -> the runtime arguments recipes supply, for every documented target of the sections."""
    from automodel.config import Target

    found: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        if isinstance(spec, Target):
            for target in spec.documented_targets:
                found[target] = tuple(dict.fromkeys(found.get(target, ()) + spec.runtime_args))
    return found


def describe_callable(dotted: str, runtime_args: tuple[str, ...]) -> list[str]:
    """One documented target: what it is, the names configs may give it, and its arguments."""
    import inspect

    from automodel.plugins.manager import get_plugin_manager

    resolver = get_plugin_manager().resolver()
    fn = resolver.resolve(dotted)
    names = sorted(alias for alias in resolver.aliases if resolver.expand(alias) == dotted)
    doc = " ".join(inspect.getdoc(fn).split("\n\n")[0].split()) if inspect.getdoc(fn) else ""
    lines = [f"### `{dotted}`", "", cell(doc.replace("``", "`")), ""]
    if names:
        lines += ["Also named in `_target_` as " + ", ".join(f"`{n}`" for n in names) + ".", ""]
    init = fn.__init__ if isinstance(fn, type) else fn
    hints = typing.get_type_hints(init)
    aliases = getattr(fn, "argument_aliases", {})
    helps = getattr(fn, "argument_help", {})
    lines += ["| argument | type | default | description |", "|---|---|---|---|"]
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            continue
        default = "required" if param.default is inspect.Parameter.empty else scalar(param.default)
        note = (f"another spelling of `{aliases[name]}`" if name in aliases else
                "supplied by the recipe" if name in runtime_args else cell(helps.get(name, "")))
        lines.append(f"| `{name}` | {type_name(hints.get(name, Any))} | {default} | {note} |")
    return lines + [""]


def describe_free(name: str, spec: Any) -> list[str]:
    text = (spec.help or "passed through unchecked").rstrip(".")
    checked = "No schema checks its keys; the recipe or builder that reads it does."
    return [f"### `{name}`", "", f"Free section: {text}. {checked}", ""]


def describe_alias(name: str, spec: Any) -> list[str]:
    implied = ", ".join(f"`{k}` = {scalar(v)}" for k, v in spec.implies.items())
    text = f"Top-level key: {spec.help.rstrip('.')}. Validation sets `{spec.key}` from it"
    text += f" (and {implied} unless the config gives it)." if implied else "."
    both = (f" Given with a different `{spec.key}`, this key's value acts and a note line names the one it overrides."
            if spec.wins else " Giving both with different values is an error.")
    return [f"### `{name}`", "", text + both, ""]


def describe_arguments(name: str, spec: Any) -> list[str]:
    keys = ", ".join(f"`{k}` (`{'`, `'.join(spec.homes(k))}`)" for k in spec.keys)
    defaults = "".join(f" `{k}` also sets {', '.join(f'`{dotted}`' for dotted, _ in implied)} unless the config "
                       "gives them." for k, implied in spec.implies.items())
    taken = f"only with `_target_: {spec.target}`" if spec.target else "as keys, without `_target_`"
    switch = f" `{spec.switch}: false` (true or false) makes the section set nothing." if spec.switch else ""
    refused = (f"Refused with the reason: {', '.join(spec.refused)}; any other key too." if spec.refused
               else "Any other key is refused.")
    return [f"### `{name}`", "", f"Upstream's section of arguments: {spec.help.rstrip('.')}. Accepted {taken}; each "
            f"argument sets the key it stands for (a second key only where its section is given): {keys}.{defaults}"
            f"{switch} A null sets nothing; a value that differs from the one the config gives there is an error. "
            f"{refused}", ""]


def describe_recipe(name: str, spec: Any) -> list[str]:
    return [f"### `{name}`", "", f"Recipe section: {spec.help.rstrip('.')}. `automodel recipes` lists the names.",
            ""]


def describe(name: str, spec: Any) -> list[str]:
    from automodel.config import ArgumentsFor, Free, KeyAlias, Metadata, Refused, Target
    from automodel.config.specs import RecipeRef

    if name.endswith("*"):
        shown = name[:-1] + "<name>"
        body = describe(shown, spec)
        body.insert(2, f"A family: any section named `{shown}` (`{name}` in the recipe's declaration).")
        body.insert(3, "")
        return body
    if isinstance(spec, type) and dataclasses.is_dataclass(spec):
        return describe_dataclass(name, spec)
    if isinstance(spec, Target):
        return describe_target(name, spec)
    if isinstance(spec, Free):
        return describe_free(name, spec)
    if isinstance(spec, KeyAlias):
        return describe_alias(name, spec)
    if isinstance(spec, ArgumentsFor):
        return describe_arguments(name, spec)
    if isinstance(spec, RecipeRef):
        return describe_recipe(name, spec)
    if isinstance(spec, Metadata):
        return [f"### `{name}`", "", f"Metadata section: {spec.help.rstrip('.')}. Not interpolated or validated; "
                "validation names it in a note line (as it does any top-level key starting with `_`).", ""]
    if isinstance(spec, Refused):
        return [f"### `{name}`", "", f"Refused at validation: {spec.reason}.", ""]
    return [f"### `{name}`", "", f"Declared as `{spec!r}`.", ""]


# ---- the document -------------------------------------------------------------------------------------------

def installed_recipes() -> tuple[dict[str, list[str]], dict[str, type], list[str]]:
    """recipe dotted path -> its routes; path -> class; routes whose recipe cannot be imported."""
    from automodel.cli.execute import import_recipe
    from automodel.errors import UsageError
    from automodel.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    routes: dict[str, list[str]] = {}
    classes: dict[str, type] = {}
    broken: list[str] = []
    for route in sorted(manager.routes.routes.values(), key=lambda r: (r.command, r.domain)):
        try:
            classes[route.recipe] = import_recipe(route.recipe)
        except UsageError as err:
            broken.append(f"{route.command} {route.domain}: {err}")
            continue
        routes.setdefault(route.recipe, []).append(f"{route.command} {route.domain}")
    return routes, classes, broken


def render() -> str:
    from automodel.recipe import BaseRecipe
    from automodel.training.recipe import TrainRecipe

    routes, classes, broken = installed_recipes()
    if broken:
        raise SystemExit("cannot document routes whose recipe does not import:\n  " + "\n  ".join(broken))
    engine = TrainRecipe.all_sections()
    out = [
        "# Configuration reference",
        "",
        "<!-- GENERATED by scripts/gen_config_reference.py from the installed recipes' declared sections: do not",
        "     edit by hand. Regenerate with `.venv/bin/python scripts/gen_config_reference.py`;",
        "     tests/test_docs_reference.py fails when this file and the code disagree. -->",
        "",
        "Every top-level section a recipe accepts, and every key of its keyed sections, as declared in the code.",
        "A section is one of:",
        "",
        "- **keyed**: a dataclass; the keys below, with their types and defaults, and nothing else;",
        "- **target**: built by calling its `_target_` (see [targets.md](targets.md)); its keys are that "
        "callable's keyword arguments, checked against its signature;",
        "- **free**: passed through unchecked;",
        "- **metadata**: read by nothing (upstream's `ci:`), not validated, named in a note line;",
        "- **refused**: validation refuses it, saying why.",
        "",
        "Any other top-level section is an error with a did-you-mean. `automodel validate -c cfg.yaml` checks a "
        "config against all of this at once; `--a.b value` overrides any key from the command line.",
        "",
        "## Installed routes",
        "",
        "| route | recipe |",
        "|---|---|",
    ]
    for name, path in sorted((name, path) for path, names in routes.items() for name in names):
        out.append(f"| `automodel {name}` | [`{path}`](#{anchor_for(path)}) |")
    out += ["", "## Engine sections (`automodel.TrainRecipe`)", "",
            "Every training recipe (a `TrainRecipe` subclass) accepts these; a recipe may redefine some (listed "
            "under the recipe).", ""]
    for name, spec in engine.items():
        out += describe(name, spec)
    for path, names in routes.items():
        cls = classes[path]
        sections = cls.all_sections()
        parents = engine if issubclass(cls, TrainRecipe) else BaseRecipe.all_sections()
        base = "automodel.TrainRecipe" if issubclass(cls, TrainRecipe) else "automodel.BaseRecipe"
        changed = {n: s for n, s in sections.items() if n not in parents or parents[n] is not s}
        inherited = [n for n in sections if n not in changed]
        out += [f"## Recipe `{path}`", "", f"Routes: {', '.join(f'`automodel {n}`' for n in names)}. A "
                f"`{base}` subclass.", ""]
        doc = (cls.__doc__ or "").strip().splitlines()
        if doc:
            out += [cell(doc[0]), ""]
        out += ["All sections: " + ", ".join(f"`{n}`" for n in sections) + ".", ""]
        if inherited:
            out += [f"As in {'the engine sections above' if base == 'automodel.TrainRecipe' else base}: "
                    + ", ".join(f"`{n}`" for n in inherited) + ".", ""]
        if changed:
            out += ["Added or redefined by this recipe:", ""]
            for name, spec in changed.items():
                out += ["#" + line if line.startswith("### ") else line for line in describe(name, spec)]
    documented = documented_targets([spec for cls in classes.values() for spec in cls.all_sections().values()])
    if documented:
        out += ["## Documented targets", "",
                "The callables sections are usually built from (their `_target_`), with every argument a config may "
                "give; a recipe supplies the ones noted. Giving an argument under both of its spellings, or one "
                "not listed, is a config error.", ""]
        for dotted, runtime_args in documented.items():
            out += describe_callable(dotted, runtime_args)
    return "\n".join(out).rstrip() + "\n"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchor_for(path: str) -> str:
    """GitHub's anchor for the heading '## Recipe `path`'."""
    return anchor(f"Recipe {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run .venv/bin/python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
