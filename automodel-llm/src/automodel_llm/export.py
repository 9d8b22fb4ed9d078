"""``automodel export``: a checkpoint's model as a plain HF model directory — consolidated from its shards when it
was saved with ``checkpoint.save_consolidated: false``, and a LoRA adapter merged into its base model."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from automodel.auto_class import loading_auto_class
from automodel.cli.trust_options import trust_options
from automodel.errors import ConfigError, ConfigIssue, UsageError

# The training run's layout of ranks: the export builds the base in this one process, where a layout for several
# (dp_replicate_size 2, tp_size 2, a teacher's own ranks) would be refused, and the weights do not depend on it.
_RANK_LAYOUT_SECTIONS = ("distributed", "teacher_distributed")


def with_recorded_base(data: dict, model_dir: Path, tokenizer_section: bool = True) -> dict:
    """The run's config with the base model and tokenizer the run recorded, never re-resolved from today's
    environment: config.yaml keeps ``${VAR}`` placeholders, so ``${BASE}`` would otherwise mean whatever BASE is
    now. The adapter's ``base_model_name_or_path`` (the resolved path, or config, the run loaded) replaces the model
    section's source, and, for a recipe with a ``tokenizer_section`` (a VLM recipe has a processor instead), the
    tokenizer saved beside the adapter replaces the tokenizer section (and upstream's form of it, a data set's
    ``tokenizer``)."""
    from automodel.config.model_paths import missing_location
    from automodel.hf import model_source, recorded_adapter_base

    found = model_source(data.get("model"))
    recorded = recorded_adapter_base(model_dir)
    if recorded is None:
        if found is not None and "${" in found[0]:
            raise UsageError(f"'{model_dir / 'adapter_config.json'}' records no base model and the run's {found[1]} "
                             f"is '{found[0]}', which today's environment would decide; set base_model_name_or_path "
                             "in adapter_config.json to the base the adapter was trained on")
        return data
    if missing_location(recorded):
        raise UsageError(f"the base model recorded with the run, '{recorded}' (adapter_config.json "
                         "base_model_name_or_path), no longer exists; restore it, or point base_model_name_or_path "
                         "at the same base")
    data = {**data, "model": {**data["model"], found[1].removeprefix("model."): recorded}} if found else data
    if tokenizer_section and (model_dir / "tokenizer_config.json").is_file():
        data["tokenizer"] = {"pretrained_model_name_or_path": str(model_dir)}
        for key, node in list(data.items()):  # upstream's form of the run's one tokenizer, in a data set section
            if (key == "dataset" or key.startswith("validation_dataset")) and isinstance(node, dict):
                data[key] = {k: v for k, v in node.items() if k != "tokenizer"}
    return data


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@trust_options
def export(checkpoint: str, output: str, force: bool) -> None:
    """Write CHECKPOINT's model as a merged Hugging Face model in OUTPUT (consolidated from its shards when it has
    no model/; LoRA adapters merged into the base).

    A LoRA checkpoint's base model is rebuilt from its config.yaml, which is untrusted like any config: it is
    validated against the registry and the trust flags of this command line (--allow-target,
    --trust-remote-code) before anything is built, and refused (exit 2) naming the file and the key.
    """
    from automodel.hf import is_adapter_dir
    from automodel.training.checkpoint import read_latest
    from automodel.training.parallel.hf_export import export_hf

    source = Path(checkpoint)
    source = read_latest(source) or source  # a checkpoint_dir means its newest checkpoint
    model_dir, shards, out = source / "model", source / "model_shards", Path(output)
    if not (model_dir.is_dir() or shards.is_dir()) or not (source / "config.yaml").is_file():
        raise UsageError(f"'{source}' is not a checkpoint directory (expected model/ or model_shards/, and "
                         "config.yaml)")
    if out.exists() and not force:
        raise UsageError(f"'{out}' already exists; pass --force to replace it")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        if not model_dir.is_dir():  # saved sharded only: stream the Hugging Face files out of the shards
            export_hf(shards, staging)
            model_dir = staging
        if is_adapter_dir(model_dir):
            _merge_adapter(source / "config.yaml", model_dir, staging)
        elif model_dir != staging:
            shutil.copytree(model_dir, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # no half-written output is left
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    click.echo(f"exported {source} to {out} ({_use_of(out)})")


def _use_of(model_dir: Path) -> str:
    """How the exported model is used: an EAGLE, P-EAGLE, DFlash or DSpark draft is served beside its target; any
    other is loaded with the Auto class of its architecture."""
    from automodel_llm.dflash.draft import ARCHITECTURE as DFLASH
    from automodel_llm.dflash.spark import ARCHITECTURE as DSPARK
    from automodel_llm.dflash.spark import GEMMA4_ARCHITECTURE as DSPARK_GEMMA4
    from automodel_llm.eagle.draft import ARCHITECTURE as EAGLE
    from automodel_llm.eagle3.draft import ARCHITECTURE as EAGLE3

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    architectures = config.get("architectures")
    served = "with SGLang or vLLM"
    kinds = ((EAGLE3, "a P-EAGLE draft" if config.get("parallel_drafting") else "an EAGLE-3 draft",
              "with vLLM's parallel drafting" if config.get("parallel_drafting") else served),
             (EAGLE, "an EAGLE-1/2 draft", served), (DFLASH, "a DFlash draft", served),
             (DSPARK, "a DSpark draft", "with an engine that drafts with DSpark"),
             (DSPARK_GEMMA4, "a DSpark draft", "with an engine that drafts with DSpark"))
    for architecture, kind, engines in kinds:
        if architectures == [architecture]:
            return f"{kind} ({architecture}): serve it as the speculative model beside its target {engines}"
    return f"load with {loading_auto_class(model_dir)}.from_pretrained('{model_dir}')"


def _adapter_recipe(adapter_dir: Path, data: dict, manager: Any) -> type:
    """The recipe that trained the adapter: the one the checkpoint's config.yaml names (every checkpoint names it,
    so the base is built as training built it), else, for a checkpoint written before it did, the fine-tuning
    route's for peft's task: ``seq-cls`` for sequence classification (the classifier's LoRA, its head saved with
    it), else ``llm``."""
    from automodel.cli.execute import import_recipe, recipe_from_config

    if "recipe" in data:
        return recipe_from_config(data, manager)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    domain = "seq-cls" if config.get("task_type") == "SEQ_CLS" else "llm"
    return import_recipe(manager.routes.get("finetune", domain).recipe)


def _merge_adapter(config_file: Path, adapter_dir: Path, out: Path) -> None:
    """The base model rebuilt from the run's (checked) config, the adapter loaded and merged, saved in ``out``."""
    from automodel.config import build_config, load_yaml_file
    from automodel.hf import load_adapter_weights
    from automodel.meta_build import building_on_meta
    from automodel.plugins.manager import get_plugin_manager
    from automodel.training.model_init import materialize_model, on_meta
    from automodel.training.rng import StatefulRNG

    manager = get_plugin_manager()
    data = {key: node for key, node in load_yaml_file(config_file).items() if key not in _RANK_LAYOUT_SECTIONS}
    try:
        recipe_cls = _adapter_recipe(adapter_dir, data, manager)
        data = with_recorded_base(data, adapter_dir, "tokenizer" in recipe_cls.all_sections())
        cfg = build_config(data, recipe_cls, manager.resolver(), source=str(config_file))
    except ConfigError as err:
        raise ConfigError([ConfigIssue(f"{config_file}: {issue.key}", issue.message, issue.suggestion)
                           for issue in err.issues]) from None
    recipe = recipe_cls(cfg)
    ctx = recipe.build_context()
    StatefulRNG(cfg.rng.seed, cfg.rng.ranked)  # seeded as training was, so a from_config base is identical
    recipe.setup_domain()
    with building_on_meta() as meta:  # built as training built it: the same base weights
        base = recipe.build_model(ctx)
    lora = recipe_cls.merged("stage_implementations").get("peft", "lora")  # the recipe's (a VLM's: its LLM part)
    model, _ = manager.stages.get("peft", lora)(ctx, base)
    if on_meta(model):  # the base from its files or the seeded module-by-module initialisation
        materialize_model(replace(ctx, meta_build=meta), model)
    load_adapter_weights(model, adapter_dir)
    merged = model.merge_and_unload()
    shutil.rmtree(out, ignore_errors=True)  # a consolidated adapter, read by now
    merged.save_pretrained(str(out))
    recipe.save_artifacts(out)  # the tokenizer / processor files, as training saved them
