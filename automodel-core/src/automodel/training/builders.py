"""The core's builders, registered for every domain. Each is ``fn(ctx, ...)`` and returns one component.

A recipe reaches them through its ``build_*`` methods (which a domain overrides where it differs); a third-party
plugin replaces one for a domain with ``builders.add(name, fn, domain=...)``, called with the same arguments.
A section's default (AdamW for ``optimizer``, a StatefulDataLoader for ``dataloader``, ...) is its ``Target``
spec's, read through ``ctx.section``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import signal
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from automodel.config import BuildError, ConfigNode, TargetResolver
from automodel.config.instantiate import build_value, callable_value
from automodel.config.targets import TargetError
from automodel.errors import AutomodelError, ConfigError, ConfigIssue
from automodel.training.bucket_sampler import BucketBatchSampler, length_buckets
from automodel.training.checkpoint import Checkpointer
from automodel.training.context import BuildContext, accepted
from automodel.training.dist import distributed_sampler
from automodel.training.loss import as_sum_loss
from automodel.training.modules import trainable_parameters
from automodel.training.sections import CheckpointConfig
from automodel.training.step_scheduler import StepScheduler


def build_model(ctx: BuildContext) -> torch.nn.Module:
    model = ctx.instantiate("model")
    if not isinstance(model, torch.nn.Module):
        raise AutomodelError(f"model: {ctx.cfg.model.target} returned {type(model).__name__}, not a "
                             "torch.nn.Module; name a model class or factory in model._target_")
    return model


def build_dataset(ctx: BuildContext, node: ConfigNode, runtime_args: dict[str, Any]) -> Any:
    """A data set section (``dataset``, ``validation_dataset*``) with the recipe's runtime arguments; never empty."""
    dataset = ctx.instantiate(node, **runtime_args)
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise AutomodelError(f"{node.key}: the data set is empty; check its path and filters")
    return dataset


def build_optimizer(ctx: BuildContext, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer over the trainable parameters; one that names a ``model`` parameter (Muon, which groups the
    parameters by the modules holding them) also gets the model. Only by that name: an optimizer taking
    ``**kwargs`` passes them on, and must not get a ``model`` it never asked for."""
    params = trainable_parameters(model)
    if not params:
        raise ConfigError(ConfigIssue("freeze", "every parameter is frozen: nothing would train"))
    node = ctx.section("optimizer")
    target = node.resolver.resolve(node.target or ctx.default_target(node))
    return ctx.instantiate(node, params=params, **({"model": model} if _names_model(target) else {}))


def _names_model(fn: Callable) -> bool:
    try:
        return "model" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_loss_fn(ctx: BuildContext) -> torch.nn.Module:
    return as_sum_loss(ctx.instantiate("loss_fn"))


def build_lr_scheduler(ctx: BuildContext, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    node = ctx.section("lr_scheduler")
    if node is None:
        return None
    runtime = {"optimizer": optimizer}
    if "total_steps" not in node:
        runtime["total_steps"] = total_steps
    return ctx.instantiate(node, **runtime)


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


def configured_collate(value: Any, resolver: TargetResolver, key: str, collate_args: Mapping[str, Any]) -> Any:
    """What a ``collate_fn`` value names, as a loader's collate function: the callable is passed, not called (a
    ``functools.partial`` with the node's other keys); a collator class is built once with those keys and the
    ``collate_args`` (the recipe's ``collate_runtime_args()``: its tokenizer or processor) its constructor names,
    as upstream does."""
    fn = callable_value(value, resolver, key)
    cls = fn.func if isinstance(fn, functools.partial) else fn
    if not isinstance(cls, type):
        return fn
    given = fn.keywords if isinstance(fn, functools.partial) else {}  # the section's own keys win
    try:
        return fn(**{k: v for k, v in accepted(cls, dict(collate_args)).items() if k not in given})
    except AutomodelError:
        raise
    except Exception as err:
        raise BuildError(key, f"{cls.__module__}.{cls.__qualname__}", err) from err


def _collate(ctx: BuildContext, node: ConfigNode, default: Callable | None) -> Any:
    """The loader's collate function: the recipe's default, or what ``collate_fn`` names (see
    :func:`configured_collate`)."""
    value = node.to_dict().get("collate_fn")
    if value is None:
        return None if default is None else CheckedCollate(default, f"{node.key} (the recipe's default collate_fn)")
    key = f"{node.key}.collate_fn"
    return CheckedCollate(configured_collate(value, ctx.cfg.resolver, key, ctx.collate_args), key)


def _seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


# upstream's dataloader arguments that build_dataloader reads itself (validated by loader_type_issues)
LOADER_BUILDER_ARGS = {
    "dataloader_type": "upstream's choice of Megatron's sampler, for a data set that declares it takes one "
                       "(MegatronPretraining): single reads the samples in order, cyclic reshuffles them every "
                       "epoch (the same as shuffle: false / true); resumable either way",
    "group_by_length": "true: batches of samples of similar lengths (upstream's length grouping: the samples sorted "
                       "by length are cut into groups of batch_size per data-parallel rank, which are shuffled each "
                       "epoch with shuffle: true), so less of each batch is padding; false (the default): batches "
                       "drawn from the whole data set",
}
_LOADER_DATA = {"dataloader": "dataset", "validation_dataloader": "validation_dataset"}


def loader_type_issues(cfg: Any, nested_data: bool = False) -> list[ConfigIssue]:
    """A ``dataloader_type`` that is neither single nor cyclic, contradicts ``shuffle``, or feeds a data set
    section (``validation_dataloader``: every ``validation_dataset*``) whose callable has no ``dataloader_types``
    (upstream refuses it with any data set but Megatron's); a data set given inside the loader (upstream's legacy
    ``dataloader.dataset``) where the recipe does not read it there (``nested_data``: it does)."""
    issues = []
    for loader_key, data_key in _LOADER_DATA.items():
        loader = cfg.resolved.get(loader_key)
        if not nested_data and isinstance(loader, Mapping) and "dataset" in loader:
            issues.append(ConfigIssue(f"{loader_key}.dataset", f"this recipe reads its data set from the top-level "
                                      f"{data_key} section, not from inside the loader (upstream's legacy form, read "
                                      f"by the retrieval recipes only); move it to {data_key}:"))
        kind = loader.get("dataloader_type") if isinstance(loader, Mapping) else None
        group = loader.get("group_by_length", False) if isinstance(loader, Mapping) else False
        if group not in (True, False):
            issues.append(ConfigIssue(f"{loader_key}.group_by_length", f"expected true or false, found {group!r}"))
        elif group and kind is not None:
            issues.append(ConfigIssue(f"{loader_key}.group_by_length", f"true with dataloader_type {kind}: one orders "
                                      "the samples by length, the other as Megatron's sampler does; remove one"))
        if kind is None:
            continue
        key = f"{loader_key}.dataloader_type"
        if kind not in ("single", "cyclic"):
            issues.append(ConfigIssue(key, f"{kind!r}; single (in order) or cyclic (reshuffled every epoch)"))
            continue
        if "shuffle" in loader and bool(loader["shuffle"]) != (kind == "cyclic"):
            issues.append(ConfigIssue(key, f"{kind} contradicts {loader_key}.shuffle: {loader['shuffle']}; "
                                           "remove one of the two"))
        for name in cfg.section_names():
            node = cfg.resolved.get(name)
            if not (name == data_key or name.startswith(f"{data_key}_")) or not isinstance(node, Mapping) \
                    or "_target_" not in node:
                continue
            try:
                takes = getattr(cfg.resolver.resolve(node["_target_"]), "dataloader_types", ())
            except TargetError:
                continue  # section validation reported the target
            if kind not in takes:
                issues.append(ConfigIssue(key, f"upstream's choice of Megatron's sampler for Megatron's indexed "
                                               f"pretraining data (MegatronPretraining), which {name} is not: remove "
                                               "the key (shuffle: true / false chooses the order here)"))
    return issues


def build_dataloader(ctx: BuildContext, dataset: Any, node: ConfigNode, train: bool,
                     default_collate: Callable | None) -> StatefulDataLoader:
    """A resumable loader over ``dataset`` as ``node`` (a dataloader section) says (``torch.utils.data.DataLoader``
    is built as torchdata's ``StatefulDataLoader``, its subclass, so checkpoints hold its position); for training
    shuffled each epoch by the run's seed (``dist.distributed_sampler``: the same order on any number of ranks), of
    which each data-parallel rank reads its own shard. ``default_collate`` is the recipe's."""
    settings = {k: build_value(v, ctx.cfg.resolver, f"{node.key}.{k}") for k, v in node.to_dict().items()
                if k not in ("_target_", "collate_fn")}
    if settings.get("batch_size") is None:  # null too: upstream's "the data set yields batches" (see plan)
        settings["batch_size"] = ctx.batch.micro_batch_size
    kind = settings.pop("dataloader_type", None)  # validated: single or cyclic, agreeing with shuffle
    shuffle = settings.pop("shuffle", train if kind is None else kind == "cyclic")
    if not torch.cuda.is_available():
        if settings.get("pin_memory"):  # upstream's configs set it; it speeds host-to-GPU copies only
            ctx.log(f"note: {node.key}.pin_memory: true governs nothing this run: pinned host memory speeds copies "
                    "to a GPU, and this run has none")
        settings["pin_memory"] = False
    # the loader's own generator: each new iterator draws its workers' base seed from it, or, without one, from
    # torch's global RNG, which a resumed run restores before that draw (the uninterrupted run drew it at the
    # epoch's start): the draw shifted every random number after a resume (diffusion's noise and timesteps)
    settings["generator"] = _seeded(ctx.seed)
    if settings.get("num_workers"):
        settings["worker_init_fn"] = functools.partial(_start_worker, settings.get("worker_init_fn"))
        _end_workers_at_exit()
    buckets = getattr(dataset, "batch_sampler", None)
    if settings.pop("group_by_length", False):  # validated: true or false
        if callable(buckets) or not hasattr(dataset, "__len__"):
            raise AutomodelError(f"{node.key}.group_by_length: true, but the data set draws its own batches or has no "
                                 "length to sort its samples by; remove the key")
        buckets = functools.partial(length_grouped, dataset, node.key)
    if callable(buckets):  # a data set of size buckets draws each batch within one bucket (its tensors stack)
        settings["batch_sampler"] = buckets(settings.pop("batch_size"), shuffle, settings.pop("drop_last", False),
                                            ctx.seed, ctx.mesh.dp, ctx.mesh.dp_rank(ctx.rank))
        return _loader_class(ctx, node)(dataset=dataset, collate_fn=_collate(ctx, node, default_collate), **settings)
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)  # shards and shuffles itself in one replica
    sampler = distributed_sampler(dataset, shuffle, ctx.seed, ctx.mesh.dp, ctx.mesh.dp_rank(ctx.rank)) \
        if not iterable or ctx.mesh.dp > 1 else None
    if sampler is not None:
        settings["sampler"] = sampler
    else:
        settings["shuffle"] = shuffle
    return _loader_class(ctx, node)(dataset=dataset, collate_fn=_collate(ctx, node, default_collate), **settings)


def _start_worker(init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A loader worker leaves SIGTERM and SIGINT to the training process, then runs the config's ``worker_init_fn``.
    A scheduler's preemption signals every process of the job and Ctrl-C the terminal's whole process group: a
    worker killed by it mid-step makes torch raise in the training process at once, which then cannot finish its
    step and write the checkpoint (``signals.StopRequest``). The workers still end when the loader shuts them down
    or the training process exits."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if init is not None:
        init(worker_id)


@functools.cache
def _end_workers_at_exit() -> None:
    """At exit, before multiprocessing ends the daemonic children (loader workers) with SIGTERM and waits for them,
    which workers that ignore SIGTERM would never answer: end them with SIGKILL first (exit handlers run last
    registered first). A loader's iterator ends its workers itself when it is done; this is for a run that stops
    while one is open (a signal, an error). Torch's SIGCHLD handler, which would report the killed workers as a
    failure, is put back to the default first."""
    def kill_daemonic_children() -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()

    atexit.register(kill_daemonic_children)


def _loader_class(ctx: BuildContext, node: ConfigNode) -> Any:
    loader = ctx.cfg.resolver.resolve(node.target or ctx.default_target(node))
    if loader is torch.utils.data.DataLoader:  # upstream's configs name it: its subclass records its position
        return StatefulDataLoader
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise AutomodelError(f"{node.key}._target_: {node.target} has no state_dict / load_state_dict, so a "
                             "checkpoint could not record where the data stands; use torchdata's StatefulDataLoader "
                             "(the default)")
    return loader


def build_step_scheduler(ctx: BuildContext, steps_per_epoch: int | None) -> StepScheduler:
    return StepScheduler(ctx.cfg.step_scheduler, ctx.batch.grad_accumulation_steps, steps_per_epoch)


def build_checkpoint_config(ctx: BuildContext) -> Checkpointer:
    return Checkpointer(ctx.cfg.checkpoint or CheckpointConfig(), ctx.cfg.to_yaml())


def length_grouped(dataset: Any, key: str, batch_size: int, shuffle: bool, drop_last: bool, seed: int,
                   replicas: int = 1, rank: int = 0) -> BucketBatchSampler:
    """``group_by_length``: batches from buckets of samples of similar lengths (:func:`length_buckets`), each
    sample's length its ``input_ids``'."""
    lengths = []
    for index in range(len(dataset)):
        sample = dataset[index]
        ids = sample.get("input_ids") if isinstance(sample, Mapping) else None
        if ids is None:
            raise AutomodelError(f"{key}.group_by_length: sample {index} of the data set has no input_ids to measure "
                                 "its length by; remove the key")
        lengths.append(len(ids))
    return BucketBatchSampler(length_buckets(lengths, batch_size * replicas), batch_size, shuffle, drop_last, seed,
                              replicas, rank)
