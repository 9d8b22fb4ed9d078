"""How recipes declare their top-level sections: the kinds of section, and where a name finds its spec.

A recipe's ``sections`` maps a section name to one of:

* a dataclass: the section's keys, types, defaults and help (``field(metadata={"help": ..., "aliases": (...)})``);
* ``Target(...)``: a section built from ``_target_``, checked against the callable's signature;
* ``Free(...)``: a mapping passed through as it is;
* ``RecipeRef(...)``: the ``recipe`` section (see :func:`check_recipe`);
* ``KeyAlias(...)``: a top-level key standing for a key of a keyed section (upstream's ``seed:`` is ``rng.seed``),
  or, named ``section.key``, a key of one section standing for one of another (``checkpoint.restore_from``);
* ``ArgumentsFor(...)``: upstream's section of one function's arguments whose keys stand for keys of other sections
  (``parallelizer:``'s for ``distributed.*``);
* ``Metadata(...)``: a section nothing reads (upstream's ``ci:``): neither interpolated nor validated, and named in a
  note; so is any top-level key starting with ``_`` (a YAML anchor's holder, a section set aside);
* ``Refused(...)``: a section automodel cannot act on, refused with its reason (its content is not read).

A name ending in ``*`` declares a family (``validation_dataset_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from automodel.errors import ConfigIssue


@dataclass(frozen=True)
class Target:
    """A section built by calling its ``_target_``; ``runtime_args`` are supplied by the builder, not the YAML.

    ``default`` is the one place a section's default lives: the mapping an absent section stands for (built
    like a written one: its ``_target_``, else ``default_target``); None when an absent section builds nothing.
    ``documented_targets`` are the callables the section is usually built from (dotted paths): the generated
    config reference lists their arguments. ``builder_args`` are arguments upstream's form of the section takes that
    the section's builder reads itself, not the callable (name -> what it does): they are kept in the section but
    not checked against the callable's parameters; the recipe validates them.
    """

    help: str = ""
    runtime_args: tuple[str, ...] = ()
    required: bool = False
    plain: bool = False  # may be a plain mapping without _target_ (then checked against default_target)
    default_target: str | None = None
    default: Mapping[str, Any] | None = field(default=None, hash=False)
    documented_targets: tuple[str, ...] = ()
    builder_args: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Free:
    """A section whose keys are not checked here (the builder that reads it checks them)."""

    help: str = ""


@dataclass(frozen=True)
class RecipeRef:
    """The recipe a config is for: ``{_target_: pkg.Class}``, or a string: a dotted path or a recipe name an installed
    domain registered for its route (upstream's bare class names such as TrainFinetuneRecipeForNextTokenPrediction).
    """

    help: str = ""


@dataclass(frozen=True)
class KeyAlias:
    """A top-level key that stands for ``key`` (``section.name``) of a keyed section, which validation sets from it;
    ``implies`` are more keys of that section it sets unless the config gives them. Giving both the alias and the
    key with different values is an error, unless ``wins``: then the alias's value is the one that acts (upstream
    reads only the alias) and :func:`alias_notes` names the key it overrides."""

    key: str
    help: str = ""
    implies: Mapping[str, Any] = field(default_factory=dict, hash=False)
    wins: bool = False


@dataclass(frozen=True)
class ArgumentsFor:
    """Upstream's section of the arguments of one function (``_target_: target``; ``target`` None: a section of a
    recipe's arguments, with no ``_target_``) whose keys stand for keys of other sections: validation sets the
    dotted key ``keys`` names for each (``section.key`` or ``section.sub.key``; a tuple: its first, and each other
    where the config gives that section or the first pass set it), refusing a value that differs from one the config
    gives there, a key of ``refused`` with its reason, any other key, and any other ``_target_``. ``implies``: more
    dotted keys a key sets where the config does not give them, each to a value or to ``function(value)`` (the
    first always, the others where their section is given). A null value of a key that stands for others is
    upstream's "not set": it sets nothing; a refused or unknown key is refused whatever its value. ``switch``:
    upstream's on / off key of the section (``enabled``), true or false: false makes the section set nothing."""

    target: str | None
    keys: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict, hash=False)
    refused: Mapping[str, str] = field(default_factory=dict, hash=False)
    help: str = ""
    implies: Mapping[str, tuple[tuple[str, Any], ...]] = field(default_factory=dict, hash=False)
    switch: str | None = None

    def homes(self, key: str) -> tuple[str, ...]:
        """The dotted keys ``key`` stands for."""
        home = self.keys[key]
        return (home,) if isinstance(home, str) else tuple(home)


@dataclass(frozen=True)
class Metadata:
    """A section nothing in a run reads: neither interpolated nor validated; validation names it in a note."""

    help: str = ""


@dataclass(frozen=True)
class Refused:
    """A section automodel cannot act on: validation refuses it with ``reason``, without reading its content."""

    reason: str


SectionSpec = type | Target | Free | RecipeRef | KeyAlias | ArgumentsFor | Metadata | Refused


def is_inert(name: str, sections: dict[str, SectionSpec]) -> bool:
    """Whether a top-level section's content is left unread (metadata, a key starting with ``_``, or refused)."""
    return str(name).startswith("_") or isinstance(find_spec(str(name), sections), (Metadata, Refused))


def metadata_note(data: dict, sections: dict[str, SectionSpec]) -> str | None:
    """The one note line naming the config's metadata sections (None when it has none)."""
    named = []
    for name in data:
        spec = find_spec(str(name), sections)
        if isinstance(spec, Metadata):
            named.append(f"'{name}' ({spec.help.rstrip('.')})" if spec.help else f"'{name}'")
        elif str(name).startswith("_") and spec is None:
            named.append(f"'{name}' (a top-level key starting with '_')")
    return f"note: not validated and read by nothing in the run: {', '.join(named)}" if named else None


def apply_key_aliases(data: dict, sections: dict[str, SectionSpec], issues: list[ConfigIssue]) -> dict:
    """``data`` with every ``KeyAlias`` copied into the section key it stands for. An alias named ``section.key``
    (upstream's ``checkpoint.restore_from``) is a key of another section, taken out of it (a null one too)."""
    out = dict(data)
    for name, spec in sections.items():
        if not isinstance(spec, KeyAlias):
            continue
        value = data.get(name)
        if "." in name:
            home, own = name.split(".", 1)
            holder = out.get(home)
            if not isinstance(holder, dict) or own not in holder:
                continue
            value = holder[own]
            out[home] = {k: v for k, v in holder.items() if k != own}
        if value is None:
            continue
        section, key = spec.key.split(".", 1)
        node = out.get(section) or {}
        if not isinstance(node, dict):
            continue  # the section's own check reports it
        if key in node and node[key] != value and not spec.wins:
            issues.append(ConfigIssue(name, f"{value!r} disagrees with {spec.key}: {node[key]!r}; '{name}' is "
                                            f"{spec.key} under another name: give one of them"))
            continue
        out[section] = {**{k: v for k, v in spec.implies.items() if k not in node}, **node, key: value}
    return out


def apply_arguments_for(data: dict, sections: dict[str, SectionSpec], issues: list[ConfigIssue]) -> dict:
    """``data`` with every ``ArgumentsFor`` section's keys set where they stand for (the section stays as given)."""
    out = dict(data)
    for name, spec in sections.items():
        node = data.get(name)
        if not isinstance(spec, ArgumentsFor) or node is None:
            continue
        if not isinstance(node, dict) or node.get("_target_") != spec.target:
            issues.append(_arguments_target_issue(name, spec, node))
            continue
        later, implied = [], []
        on = node.get(spec.switch, True) if spec.switch else True
        if not isinstance(on, bool):
            issues.append(ConfigIssue(f"{name}.{spec.switch}", f"must be true or false, found {on!r}"))
        for key, value in node.items():
            if key == "_target_" or key == spec.switch:
                continue
            if key in spec.refused:
                issues.append(ConfigIssue(f"{name}.{key}", spec.refused[key]))
            elif key not in spec.keys and key not in spec.implies:
                taken = [*spec.keys, *(k for k in spec.implies if k not in spec.keys), *filter(None, [spec.switch])]
                issues.append(ConfigIssue(f"{name}.{key}", f"not {_arguments_of(spec)} taken here (they are: "
                                          f"{', '.join(taken)})"))
                continue
            if value is None or on is not True:  # upstream's "not set", or the section switched off
                continue
            if key in spec.keys:
                first, *others = spec.homes(key)
                _set_dotted(out, first, value, f"{name}.{key}", issues)
                later += [(dotted, value, f"{name}.{key}") for dotted in others]
            for index, (dotted, setting) in enumerate(spec.implies.get(key, ())):
                implied.append((index == 0, dotted, setting(value) if callable(setting) else setting))
        for dotted, value, given_as in later:
            if isinstance(out.get(dotted.split(".")[0]), dict):
                _set_dotted(out, dotted, value, given_as, issues)
        for always, dotted, value in implied:
            if always or isinstance(out.get(dotted.split(".")[0]), dict):
                _set_default(out, dotted, value)
    return out


def _arguments_of(spec: ArgumentsFor) -> str:
    return f"an argument of {spec.target}" if spec.target else "one of the recipe's arguments"


def _arguments_target_issue(name: str, spec: ArgumentsFor, node: Any) -> ConfigIssue:
    found = node.get("_target_") if isinstance(node, dict) else node
    if spec.target is None:
        what = "a _target_" if isinstance(node, dict) else "not a section"
        return ConfigIssue(f"{name}._target_" if isinstance(node, dict) else name,
                           f"{found!r} is {what}: the section holds the recipe's arguments, keys only")
    stands = ", ".join(sorted({home.split(".")[0] for key in spec.keys for home in spec.homes(key)}))
    return ConfigIssue(f"{name}._target_" if isinstance(node, dict) else name,
                       f"{found!r}: only {spec.target} is taken here (its arguments stand for {stands} keys): name "
                       "it or remove the section")


def _holder(data: dict, dotted: str) -> tuple[dict, str] | None:
    """The mapping that holds ``data``'s ``dotted`` key, and the key's last part, each mapping on the way copied (so
    ``data``'s own are left as they were; a null or absent one is an empty one); None where a value on the way is
    not a mapping (the section's own check reports it)."""
    *path, last = dotted.split(".")
    holder = data
    for part in path:
        inner = holder.get(part)
        if inner is not None and not isinstance(inner, dict):
            return None
        holder[part] = dict(inner or {})
        holder = holder[part]
    return holder, last


def _set_default(data: dict, dotted: str, value: Any) -> None:
    """Set ``data``'s ``dotted`` key to ``value`` unless it is given."""
    found = _holder(data, dotted)
    if found is not None and found[0].get(found[1]) is None:
        found[0][found[1]] = value


def _set_dotted(data: dict, dotted: str, value: Any, given_as: str, issues: list[ConfigIssue]) -> None:
    """Set ``data``'s ``dotted`` key unless the config gives it a different value."""
    found = _holder(data, dotted)
    if found is None:
        return
    holder, last = found
    if last in holder and holder[last] is not None and holder[last] != value:
        issues.append(ConfigIssue(given_as, f"{value!r} disagrees with {dotted}: {holder[last]!r}; '{given_as}' is "
                                            f"{dotted} under upstream's other name: give one value, in either place"))
        return
    holder[last] = value


def alias_notes(data: dict, sections: dict[str, SectionSpec]) -> list[str]:
    """A note line for each winning ``KeyAlias`` given alongside a different value of the key it stands for."""
    notes = []
    for name, spec in sections.items():
        if not (isinstance(spec, KeyAlias) and spec.wins) or "." in name or data.get(name) is None:
            continue
        section, key = spec.key.split(".", 1)
        node = data.get(section)
        if isinstance(node, dict) and key in node and node[key] != data[name]:
            notes.append(f"note: {name}: {data[name]!r} is the value that acts, not {spec.key}: {node[key]!r} "
                         f"(upstream's recipes read only '{name}')")
    return notes


def find_spec(name: str, sections: dict[str, SectionSpec]) -> SectionSpec | None:
    if name in sections:
        return sections[name]
    for pattern, spec in sections.items():
        if pattern.endswith("*") and name.startswith(pattern[:-1]) and len(name) > len(pattern) - 1:
            return spec
    return None
