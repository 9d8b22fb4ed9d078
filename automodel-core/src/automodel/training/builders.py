"""Default builders. Each takes the recipe (and what it needs) and returns one component.

Domains override any of them for their domain through ``automodel_register_builders``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from automodel.config import ConfigNode, TargetError
from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.training.checkpoint import Checkpointer
from automodel.training.loss import as_sum_loss
from automodel.training.sections import CheckpointConfig
from automodel.training.step_scheduler import StepScheduler

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe

DEFAULT_DATALOADER = "torchdata.stateful_dataloader.StatefulDataLoader"
DEFAULT_OPTIMIZER = {"_target_": "torch.optim.AdamW", "lr": 1e-5}


def accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def instantiate_with(node: ConfigNode, runtime: dict[str, Any], default_target: str | None = None) -> Any:
    """Instantiate a node with the runtime arguments its target accepts (they win over the config's)."""
    fn = node._resolver.resolve(node.target or default_target)
    return node.instantiate(default_target=default_target, **accepted(fn, runtime))


def build_model(recipe: TrainRecipe) -> torch.nn.Module:
    model = instantiate_with(recipe.cfg.model, recipe.model_runtime_args())
    if not isinstance(model, torch.nn.Module):
        raise AutomodelError(f"model: {recipe.cfg.model.target} returned {type(model).__name__}, not a "
                             "torch.nn.Module; name a model class or factory in model._target_")
    return model


def build_optimizer(recipe: TrainRecipe, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(ConfigIssue("freeze", "every parameter is frozen: nothing would train"))
    node = recipe.cfg.optimizer or ConfigNode(dict(DEFAULT_OPTIMIZER), "optimizer", recipe.cfg.resolver)
    return node.instantiate(params=params)


def build_loss_fn(recipe: TrainRecipe) -> torch.nn.Module:
    node = recipe.cfg.loss_fn
    return as_sum_loss(node.instantiate() if node is not None else recipe.default_loss_fn())


def build_lr_scheduler(recipe: TrainRecipe, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    node = recipe.cfg.lr_scheduler
    if node is None:
        return None
    runtime = {"optimizer": optimizer}
    if "total_steps" not in node:
        runtime["total_steps"] = total_steps
    return instantiate_with(node, runtime, default_target="automodel.optim.build_scheduler")


def describe_batch(value: Any, depth: int = 0) -> str:
    """A short structural description of a batch or sample (keys, tensor shapes, list lengths) for error messages."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        if depth > 1:
            return "dict"
        return "{" + ", ".join(f"{k}: {describe_batch(v, depth + 1)}" for k, v in list(value.items())[:12]) + "}"
    if isinstance(value, (list, tuple)):
        inner = f" of {describe_batch(value[0], depth + 1)}" if value and depth < 2 else ""
        return f"{type(value).__name__}[{len(value)}]{inner}"
    return type(value).__name__


class CheckedCollate:
    """A collate function whose failures name the config key and describe the samples it was given."""

    def __init__(self, fn: Any, key: str):
        self.fn, self.key = fn, key

    def __call__(self, samples: list[Any]) -> Any:
        try:
            return self.fn(samples)
        except AutomodelError:
            raise
        except Exception as err:
            name = getattr(getattr(self.fn, "func", self.fn), "__qualname__", type(self.fn).__name__)
            sample = describe_batch(samples[0]) if samples else "nothing"
            raise AutomodelError(
                f"{self.key}: {name} failed on a batch of {len(samples)} samples (the first is {sample}): "
                f"{type(err).__name__}: {err}. The collate function turns a list of the data set's samples into "
                "the batch the recipe's compute_loss reads: remove collate_fn to use the recipe's default, or "
                "name one that accepts samples like these") from err


def _collate(recipe: TrainRecipe, node: ConfigNode | None, train: bool) -> Any:
    value = None if node is None else node.get("collate_fn")
    loader_key = node.key if node is not None else ("dataloader" if train else "validation_dataloader")
    if value is None:
        fn = recipe.default_collate_fn(train)
        return None if fn is None else CheckedCollate(fn, f"{loader_key} (the recipe's default collate_fn)")
    key = f"{node.key}.collate_fn"
    if isinstance(value, str):
        try:
            return CheckedCollate(recipe.cfg.resolver.resolve(value), key)
        except TargetError as err:
            raise ConfigError(ConfigIssue(key, str(err), err.suggestion)) from None
    return CheckedCollate(value.instantiate(), key)


def build_dataloader(recipe: TrainRecipe, dataset: Any, node: ConfigNode | None, train: bool) -> StatefulDataLoader:
    """A StatefulDataLoader (resumable) over ``dataset``; shuffled with a seeded generator for training."""
    settings = {} if node is None else {k: v for k, v in node.to_dict().items() if k not in ("_target_", "collate_fn")}
    settings.setdefault("batch_size", recipe.micro_batch_size)
    settings.setdefault("shuffle", train)
    if not torch.cuda.is_available():
        settings["pin_memory"] = False  # pinning needs an accelerator; accepted and ignored on CPU
    generator = torch.Generator()
    generator.manual_seed(recipe.cfg.rng.seed if recipe.cfg.rng else 0)
    shuffle = settings.pop("shuffle")
    sampler = recipe.data_sampler(dataset, shuffle=shuffle, generator=generator)
    if sampler is None and shuffle and not isinstance(dataset, torch.utils.data.IterableDataset):
        # The shuffling sampler gets the seeded generator to itself: the loader also draws each epoch's worker
        # base seed from its own `generator`, a draw a restored StatefulDataLoader does not replay, so sharing
        # one generator made every epoch after a resume shuffle differently from the uninterrupted run.
        sampler = RandomSampler(dataset, generator=generator)
        settings["generator"] = torch.Generator()
        settings["generator"].manual_seed(recipe.cfg.rng.seed if recipe.cfg.rng else 0)
    if sampler is not None:
        settings["sampler"] = sampler
    else:
        settings["generator"] = generator
        settings["shuffle"] = shuffle
    target = node.target if node is not None and node.target else DEFAULT_DATALOADER
    fn = recipe.cfg.resolver.resolve(target)
    return fn(dataset=dataset, collate_fn=_collate(recipe, node, train), **settings)


def build_step_scheduler(recipe: TrainRecipe, steps_per_epoch: int | None) -> StepScheduler:
    return StepScheduler(recipe.cfg.step_scheduler, recipe.grad_accumulation_steps, steps_per_epoch)


def build_checkpoint_config(recipe: TrainRecipe) -> Checkpointer:
    config = recipe.cfg.checkpoint or CheckpointConfig()
    return Checkpointer(config, recipe.cfg.to_yaml())
