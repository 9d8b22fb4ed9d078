"""Running a recipe from a config: load, override, validate, then print / plan / build and train."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import click

from automodel.cli.examples import find_example
from automodel.config import Config, TargetError, build_config, load_yaml_file, parse_overrides
from automodel.errors import ConfigError, ConfigIssue, UsageError
from automodel.plugins.manager import PluginManager

# Commands that take a config also take `--a.b value` overrides, which click would otherwise refuse.
OVERRIDE_SETTINGS = {"ignore_unknown_options": True, "allow_extra_args": True}


def resolve_config_path(config: str, manager: PluginManager) -> Path:
    """A file path, or the name of a shipped example (``llm/tiny_squad``)."""
    path = Path(config)
    if path.exists():
        return path
    example = find_example(config, manager)
    if example is not None:
        return example
    raise ConfigError(ConfigIssue("-c", f"config file '{config}' does not exist and is not the name of a shipped "
                                        "example (`automodel cp` lists them)"))


def import_recipe(dotted: str) -> type:
    """Import a route's recipe class (routes name their recipe by a trusted dotted path)."""
    from automodel.recipe import BaseRecipe

    module, _, name = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"recipe '{dotted}' cannot be imported: {type(err).__name__}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseRecipe)):
        raise UsageError(f"recipe '{dotted}' is not a subclass of automodel.BaseRecipe")
    return cls


def recipe_from_config(data: dict, manager: PluginManager) -> type:
    """The class named by a config's ``recipe:`` key, resolved through the allow-list and aliases."""
    from automodel.recipe import BaseRecipe

    node = data.get("recipe")
    if node is None:
        raise ConfigError(ConfigIssue("recipe", "missing: `automodel run` needs `recipe: Name` or "
                                                "`recipe: {_target_: pkg.Class}` (or use `automodel <command> "
                                                "<domain> -c ...`)"))
    name = node.get("_target_") if isinstance(node, dict) else node
    key = "recipe._target_" if isinstance(node, dict) else "recipe"
    try:
        cls = manager.resolver().resolve_recipe(name)
    except TargetError as err:
        raise ConfigError(ConfigIssue(key, str(err), err.suggestion)) from None
    if not issubclass(cls, BaseRecipe):
        raise ConfigError(ConfigIssue(key, f"'{name}' is not a recipe (a BaseRecipe subclass)"))
    return cls


def load_and_validate(recipe_cls: type, config_path: Path, extra_args: list[str],
                      manager: PluginManager, quiet: bool = False) -> Config:
    """The validated config; its notes go to stderr once (rank 0 only, and not by a launcher about to start the
    ranks: ``quiet``)."""
    overrides = parse_overrides(extra_args)
    data = load_yaml_file(config_path)
    cfg = build_config(data, recipe_cls, manager.resolver(), source=str(config_path), overrides=overrides)
    if not quiet and os.environ.get("RANK", "0") == "0":
        for note in cfg.notes:
            echo_err(note)
    return cfg


def planning_for(launch: dict[str, Any] | None) -> contextlib.AbstractContextManager:
    """Validation and the plan within the block are for the run ``launch`` describes (its world size)."""
    if not launch:
        return contextlib.nullcontext()
    from automodel.cli.launch import planned_world
    from automodel.training.dist import planned_world_size

    return planned_world_size(*planned_world(launch), nodes=launch.get("nnodes") or 1)


def run_recipe(recipe_cls: type, config_path: Path, extra_args: list[str], manager: PluginManager,
               dry_run: bool = False, print_config: bool = False, launch: dict[str, Any] | None = None) -> int:
    from automodel.cli.launch import needs_torchrun

    launch = launch or {}
    relaunch = needs_torchrun(launch) and not _under_torchrun()
    with planning_for(launch if relaunch else None):
        # Validated here once, for the whole launch, so a config mistake is reported once, not by every rank (the
        # notes are printed by rank 0 of the launched run, and not beside --print-config's YAML).
        quiet = print_config or (relaunch and not dry_run)
        cfg = load_and_validate(recipe_cls, config_path, extra_args, manager, quiet=quiet)
        if print_config:
            click.echo(cfg.to_yaml(), nl=False)
            return 0
        if dry_run:
            click.echo(f"config {config_path} is valid; plan:")
            for line in recipe_cls.describe_plan(cfg):
                click.echo(f"  {line}")
            click.echo("dry run: nothing was built")
            return 0
    if relaunch:
        from automodel.cli.launch import relaunch_under_torchrun

        return relaunch_under_torchrun(launch, *config_rendezvous(cfg))
    recipe = recipe_cls(cfg)
    try:
        recipe.setup()
        recipe.run_train_validation_loop()
        finished = True
    except BaseException:
        finished = False
        raise
    finally:
        _close_process_group(finished)
    return 0


def config_rendezvous(cfg: Config) -> tuple[str, int]:
    """The rendezvous torchrun is given where the command line has no --master-addr / --master-port: the config's
    ``dist_env.master_addr`` / ``master_port``, else localhost:29500."""
    env = cfg.get("dist_env")
    if env is None:
        return "localhost", 29500
    return env.master_addr or "localhost", env.master_port or 29500


def _close_process_group(finished: bool) -> None:
    """Leave a torchrun job cleanly: ranks that finished wait for each other, then every group is torn down while
    the interpreter is still whole.

    ``destroy_process_group`` only unregisters the groups: each gloo group's worker and transport threads live until
    its last Python reference goes, and the model (DDP), the device mesh and the cached checkpoint group hold such
    references, the first two in reference cycles. Left alone, those groups die during interpreter finalization,
    when a gloo thread that still needs the GIL is ended by Python mid C++ (``terminate called without an active
    exception``, SIGABRT, a nonzero exit; more likely the busier the machine). So the cached group is dropped now and
    the cycles are collected at exit, before finalization starts (atexit), which joins those threads.
    """
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is None or not torch_dist.is_available() or not torch_dist.is_initialized():
        return
    from automodel.training.parallel.writer import forget_checkpoint_group

    if finished:
        torch_dist.barrier()
    torch_dist.destroy_process_group()
    forget_checkpoint_group()
    atexit.register(gc.collect)
    global _left_a_process_group
    _left_a_process_group = True


_left_a_process_group = False  # this process ran a torchrun rank (and tore its groups down)


def exit_rank(code: int) -> int:
    """``code``, for an ordinary command; a torchrun rank that ran a recipe instead ends here: the exit handlers run
    (the cycles holding gloo groups collected, loggers flushed), the output is flushed, and the process exits
    without interpreter finalization. Once a DTensor exists (FSDP2, tensor parallelism), torch (2.13) keeps the
    default gloo group alive on its C++ side past ``destroy_process_group``, with no Python object to collect, and
    finalization could end its threads mid C++ (``terminate called without an active exception``, SIGABRT: a
    finished run reported as a failed rank). Everything the run writes is durable before this point."""
    if not _left_a_process_group:
        return code
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers interpreter shutdown would run, run now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def echo_err(message: str) -> None:
    click.echo(message, file=sys.stderr)
