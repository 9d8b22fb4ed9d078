"""``automodel export``: a LoRA checkpoint merged into its base model, written as a plain HF model directory."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import click

from automodel.cli.trust_options import trust_options
from automodel.errors import ConfigError, ConfigIssue, UsageError


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@trust_options
def export(checkpoint: str, output: str, force: bool) -> None:
    """Write CHECKPOINT's model as a merged Hugging Face model in OUTPUT (LoRA adapters merged into the base).

    A LoRA checkpoint's base model is rebuilt from its config.yaml, which is untrusted like any config: it is
    validated against the registry and the trust flags of this command line (--allow-target,
    --trust-remote-code) before anything is built, and refused (exit 2) naming the file and the key.
    """
    from automodel.cli.execute import import_recipe
    from automodel.config import build_config, load_yaml_file
    from automodel.hf import is_adapter_dir, load_adapter_weights
    from automodel.meta_build import building_on_meta
    from automodel.plugins.manager import get_plugin_manager
    from automodel.training.checkpoint import read_latest
    from automodel.training.model_init import materialize_model, on_meta
    from automodel.training.rng import StatefulRNG
    from automodel.training.stages.peft import add_lora

    source = Path(checkpoint)
    source = read_latest(source) or source  # a checkpoint_dir means its newest checkpoint
    model_dir, out = source / "model", Path(output)
    if not model_dir.is_dir() or not (source / "config.yaml").is_file():
        raise UsageError(f"'{source}' is not a checkpoint directory (expected model/ and config.yaml)")
    if out.exists() and not force:
        raise UsageError(f"'{out}' already exists; pass --force to replace it")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    if not is_adapter_dir(model_dir):
        shutil.copytree(model_dir, staging)
    else:
        manager = get_plugin_manager()
        recipe_cls = import_recipe(manager.routes.get("finetune", "llm").recipe)
        config_file = source / "config.yaml"
        try:
            cfg = build_config(load_yaml_file(config_file), recipe_cls, manager.resolver(), source=str(config_file))
        except ConfigError as err:
            raise ConfigError([ConfigIssue(f"{config_file}: {issue.key}", issue.message, issue.suggestion)
                               for issue in err.issues]) from None
        recipe = recipe_cls(cfg)
        ctx = recipe.build_context()
        StatefulRNG(cfg.rng.seed, cfg.rng.ranked)  # seeded as training was, so a from_config base is identical
        recipe.setup_domain()
        with building_on_meta() as meta:  # built as training built it: the same base weights
            base = recipe.build_model(ctx)
        model, _ = add_lora(ctx, base)
        if on_meta(model):  # the base from its files or seeded initialisation, the adapter from the checkpoint
            materialize_model(replace(ctx, meta_build=meta, restore_path=source), model)
        else:
            load_adapter_weights(model, model_dir)
        merged = model.merge_and_unload()
        merged.save_pretrained(str(staging))
        recipe.tokenizer.save_pretrained(str(staging))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    click.echo(f"exported {source} to {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))")
