"""What builders and pipeline stages may see: the run's config and environment, nothing of the recipe itself.

``TrainRecipe.setup`` makes one ``BuildContext`` and hands it to every builder (``fn(ctx, ...)``) and every
stage (``fn(ctx, model) -> (model, message)``); they return what they build and write nothing back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.config import Config, ConfigNode, Target
from automodel.config.specs import find_spec
from automodel.errors import AutomodelError, PluginError
from automodel.meta_build import MetaBuild
from automodel.training.parallel.mesh import MeshLayout
from automodel.training.parallel.precision import Precision

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.plugins.manager import PluginManager


@dataclass(frozen=True)
class BatchLayout:
    """How the samples of one optimizer step are laid out (checked at validation, see ``plan.batch_layout``)."""

    micro_batch_size: int  # samples per micro-batch on one rank
    dp_size: int  # data-parallel ranks
    grad_accumulation_steps: int  # micro-batches per optimizer step

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.dp_size * self.grad_accumulation_steps


@dataclass(frozen=True)
class BuildContext:
    cfg: Config  # the validated config
    sections: Mapping[str, Any]  # the recipe's declared sections (a Target spec holds its section's default)
    plugins: PluginManager  # the registries: builders, stages, loggers
    domain: str | None  # the recipe's domain: selects domain-specific registered builders
    device: torch.device
    rank: int
    world_size: int
    seed: int  # rng.seed
    batch: BatchLayout
    log: Callable[[str], None]  # one line to the user (rank 0 prints)
    load_model_weights: Callable[[torch.nn.Module, Path], None]  # the recipe's reader of a saved model/ directory
    restore_path: Path | None = None  # the checkpoint this run resumes from (restore_from.path, resolved)
    # how the ranks split into pp x dp_replicate x dp_shard x cp x tp (training/parallelism.py; 1 rank: all 1)
    mesh: MeshLayout = field(default_factory=lambda: MeshLayout(1))
    device_mesh: DeviceMesh | None = None  # the torch DeviceMesh of ``mesh`` (None in a single process)
    precision: Precision = field(default_factory=Precision)  # distributed.mp_policy / autocast_dtype, resolved
    fsdp2: bool = False  # the sharding slot runs the core's FSDP2 (its policy casts; no autocast around it)
    meta_build: MetaBuild | None = None  # set when the model factory built on the meta device (automodel.meta_build)
    # what a collator class named by a `collate_fn` node is built with (the recipe's tokenizer or processor)
    collate_args: Mapping[str, Any] = field(default_factory=dict)
    # the recipe's names of the model's multimodal modules (TrainRecipe.multimodal_module_names), for FSDP2
    multimodal_names: tuple[str, ...] = ()
    # whether distributed.tp_size and ep_size split the run's model (False: the recipe splits another model with them,
    # such as a draft recipe's frozen target, and the run's model stays whole on each tensor-parallel rank)
    splits_run_model: bool = True

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def build(self, name: str, *args: Any) -> Any:
        """Call the builder registered for ``name`` (this domain's, else the default) as ``fn(self, *args)``."""
        registry = self.plugins.builders
        entry = registry.builders.get((name, self.domain)) or registry.builders.get((name, None))
        try:
            return registry.get(name, self.domain)(self, *args)
        except AutomodelError:
            raise
        except Exception as err:  # a plugin's builder failed: name the plugin (the core's own propagate as they are)
            if entry is None or entry.source in ("core", "automodel-core"):
                raise
            raise PluginError(f"builder '{name}' registered by plugin '{entry.source}' failed: "
                              f"{type(err).__name__}: {err} (AUTOMODEL_DEBUG=1 shows the traceback)") from err

    def section(self, name: str) -> ConfigNode | None:
        """The config's section ``name``, or the mapping its ``Target`` spec declares as the default when absent."""
        node = self.cfg.get(name)
        spec = find_spec(name, self.sections)
        if node is None and isinstance(spec, Target) and spec.default is not None:
            node = ConfigNode(dict(spec.default), name, self.cfg.resolver)
        return node

    def instantiate(self, node: ConfigNode | str | None, **runtime: Any) -> Any:
        """Build a target section (a node, or a section name: see ``section``); None when there is nothing to build.

        A node without ``_target_`` uses its spec's ``default_target``; of ``runtime`` (model parameters, a
        tokenizer, ...) only the arguments the target accepts are passed, and they win over the config's keys.
        """
        if isinstance(node, str):
            node = self.section(node)
        if node is None:
            return None
        return node.instantiate(default_target=self.default_target(node),
                                **accepted(node.resolver.resolve(node.target or self.default_target(node)), runtime))

    def default_target(self, node: ConfigNode) -> str | None:
        """What a section without ``_target_`` calls: its ``Target`` spec's ``default_target``."""
        spec = find_spec(node.key, self.sections)
        return spec.default_target if isinstance(spec, Target) else None


def accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}
