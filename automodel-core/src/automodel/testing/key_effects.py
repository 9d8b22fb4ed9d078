"""Checking that every key of a recipe's keyed sections acts or is refused (issue 20: no silently ignored key).

A key *acts* when code reads it after validation: while the recipe sets up and trains, while ``--nproc-per-node``
builds the launch, or while ``--slurm`` writes its script. A key is *refused* when validation refuses it with a
reason. :func:`key_effects` runs those phases once per context with every keyed section's reads recorded (the
attribute reads of the section's dataclass instances), validates each key at non-default values, and reports each
key as read (where), refused (why) or neither, which is the failure the meta-test looks for. Plugin authors can run
it on their own recipe's sections the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from automodel.config.schema import section_fields
from automodel.errors import ConfigError
from automodel.testing import deep_update


@dataclass(frozen=True)
class KeyEffect:
    section: str
    key: str
    read_by: str | None = None  # "module:line" of the first read after validation
    refused: str | None = None  # the message validation gave for a non-default value

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def ok(self) -> bool:
        return self.read_by is not None or self.refused is not None


def keyed_sections(recipe: type) -> dict[str, type]:
    """The recipe's keyed (dataclass) sections by name."""
    return {name: spec for name, spec in recipe.all_sections().items()
            if isinstance(spec, type) and dataclasses.is_dataclass(spec)}


@contextlib.contextmanager
def recorded_reads(classes: list[type]) -> Iterator[dict[tuple[type, str], str]]:
    """Record, per (section class, field), where it is first read while the block runs."""
    reads: dict[tuple[type, str], str] = {}
    saved = {}
    for cls in set(classes):
        names = {f.name for f in dataclasses.fields(cls)}

        def getattribute(self: Any, name: str, _cls: type = cls, _names: set = names) -> Any:
            if name in _names and (_cls, name) not in reads:
                caller = sys._getframe(1)
                reads[(_cls, name)] = f"{caller.f_globals.get('__name__')}:{caller.f_lineno}"
            return object.__getattribute__(self, name)

        saved[cls] = cls.__dict__.get("__getattribute__")
        cls.__getattribute__ = getattribute
    try:
        yield reads
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = original


def probe_values(f: dataclasses.Field, tp: Any, given: Mapping[str, Any]) -> list[Any]:
    """Non-default values of a field's type to validate it with (``given`` names the field's own)."""
    if f.name in given:
        return list(given[f.name])
    default = None if f.default is dataclasses.MISSING else f.default
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    members = [a for a in (typing.get_args(tp) if union else (tp,)) if a is not type(None)]
    literals = [v for a in members if typing.get_origin(a) is Literal for v in typing.get_args(a)]
    if literals:
        return [v for v in literals if v != default][:2]
    kinds = {typing.get_origin(a) or a for a in members}
    if bool in kinds:
        return [not default]
    if int in kinds:
        return [(default or 1) + 1, (default or 1) + 7]
    if float in kinds:
        return [(default or 1.0) * 2 + 0.5]
    if str in kinds:
        return ["probe-value"]
    if list in kinds:
        item = (typing.get_args(next(a for a in members if typing.get_origin(a) is list or a is list)) or (str,))[0]
        return [[2] if item is int else ["probe-value"]]
    return []


def _refusal(data: dict, dotted: str, validate: Callable[[dict], Any]) -> str | None:
    try:
        validate(data)
    except ConfigError as err:
        found = [i.message for i in err.issues if i.key == dotted or i.key.startswith(dotted + ".")]
        return found[0] if found else None
    return None


def key_effects(recipe: type, base: dict, sections: list[str], validate: Callable[[dict], Any],
                phases: list[Callable[[Any], None]], contexts: Mapping[str, dict] = (),
                probes: Mapping[str, Mapping[str, list[Any]]] = ()) -> list[KeyEffect]:
    """Each key of ``sections`` (keyed sections of ``recipe``) as read, refused or neither.

    ``base`` is a config the recipe runs; ``validate(data) -> cfg`` validates one; each of ``phases(cfg)`` runs a
    part of the product with the config (setting up and training, building the launch, writing the slurm script).
    The phases run twice: on ``base``, then with every section's context merged in: ``contexts[section]``, the
    settings that make the section's keys matter (``compile: {enabled: true, backend: eager}``), by default
    ``enabled: true`` for a section that has that key. A context validation refuses (FP8 without a GPU) stays out,
    and the section's keys that nothing read are reported refused with that reason. ``probes[section][key]`` are
    the non-default values to validate a key with (else derived from its type): a key nothing read is refused when
    validation refuses every one of them at that key.
    """
    declared = keyed_sections(recipe)
    classes = [declared[name] for name in sections]
    reads: dict[tuple[type, str], str] = {}
    context_refused: dict[str, str] = {}  # section -> why validation refuses the context its keys act in
    merged: dict = {}
    for name in sections:
        context = _context(declared[name], dict(contexts).get(name))
        if context:
            why = _refusal_of(deep_update(base, {name: context}), validate)
            if why is None:
                merged = deep_update(merged, {name: context})
            else:
                context_refused[name] = why
    for overrides in ([{}, merged] if merged else [{}]):
        cfg = validate(_fresh_run(deep_update(base, overrides)))
        with recorded_reads(classes) as found:
            for phase in phases:
                phase(cfg)
        for where_read, where in found.items():
            reads.setdefault(where_read, where)
    effects = []
    for name in sections:
        cls = declared[name]
        for f, tp in section_fields(cls):
            read_by = reads.get((cls, f.name))
            refused = None
            if read_by is None:
                values = probe_values(f, tp, dict(dict(probes).get(name, {})))
                messages = [_refusal(deep_update(base, {name: {f.name: v}}), f"{name}.{f.name}", validate)
                            for v in values]
                refused = messages[0] if values and all(messages) else context_refused.get(name)
            effects.append(KeyEffect(name, f.name, read_by, refused))
    return effects


def _fresh_run(data: dict) -> dict:
    """``data`` as a fresh run: a ``checkpoint.checkpoint_dir`` that already exists (an earlier pass saved there)
    is replaced by a new one beside it, since a run started where another saved resumes it (and, resumed at its
    last step, would train no step to read keys in)."""
    where = (data.get("checkpoint") or {}).get("checkpoint_dir")
    if not where or not Path(str(where)).exists():
        return data
    index = 1
    while Path(f"{where}-pass{index}").exists():
        index += 1
    return deep_update(data, {"checkpoint": {"checkpoint_dir": f"{where}-pass{index}"}})


def _context(cls: type, given: dict | None) -> dict:
    """The settings a section's keys act under: those given, else ``enabled: true`` for a section that has it."""
    if given is not None:
        return given
    return {"enabled": True} if any(f.name == "enabled" for f in dataclasses.fields(cls)) else {}


def _refusal_of(data: dict, validate: Callable[[dict], Any]) -> str | None:
    try:
        validate(data)
    except ConfigError as err:
        return "; ".join(f"{i.key}: {i.message}" for i in err.issues)
    return None


def run_phase(recipe: type) -> Callable[[Any], None]:
    """The phase that sets the recipe up and runs it (in the current directory)."""
    def run(cfg: Any) -> None:
        instance = recipe(cfg)
        instance.setup()
        instance.run_train_validation_loop()
    return run


def launch_phase(cfg: Any) -> None:
    """What ``--nproc-per-node 2`` builds from the config before starting the processes."""
    from automodel.cli.execute import config_rendezvous
    from automodel.cli.launch import torchrun_command

    torchrun_command({"nproc_per_node": 2}, ["run", "-c", "cfg.yaml"], *config_rendezvous(cfg))


def slurm_phase(cfg: Any) -> None:
    """What ``--slurm`` writes from the config's ``slurm:`` section (``slurm.script``, in the current directory)."""
    from automodel.cli.slurm import write_sbatch

    if cfg.get("slurm") is not None:
        write_sbatch(cfg.slurm, ["run", "-c", "cfg.yaml"])
