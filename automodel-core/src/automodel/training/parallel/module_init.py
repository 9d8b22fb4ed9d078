"""Fresh weights for a model built on the meta device, module by module (what :mod:`.materialize` fills in).

Fresh initialisation is defined module by module: in a fixed order, each module's full parameters are initialised
with the random generator seeded from ``(seed, module name)`` (the name in the base model: with or without LoRA, the
base weights are the same); each rank then keeps its slice. A module is initialised as transformers initialises a
model, whose ``_init_weights`` runs on every module, children before their parent, so that a parent may set its
children's parameters (CLIP's vision embeddings set the patch convolution, its attention the projections): the
model's ``_init_weights`` of the module, then of each module holding it, while every other parameter is a meta
stand-in that takes no write. A parameter these calls leave unset gets what a CPU build gives it: the module's
``reset_parameters()`` (what its constructor ran), then the same calls. LoRA layers get peft's initialiser; a DoRA
magnitude, once every base weight is set, the norms of its base weight's rows, as peft computes it (``lora_B`` is
zero then), each rank its own rows. One process and N ranks use this same function, so they get the same weights,
and no rank holds more than one module's full parameters at a time. (It is not the random stream of
``AutoModelForCausalLM.from_config`` after ``torch.manual_seed``: reproducing that needs the whole model at once;
the distributions are the model's.)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.blocks import clean_name

_LORA_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
_LORA_INITS = (True, "gaussian", False)


def local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's local part of ``tensor`` (a ``DTensor`` or a plain tensor) and where it sits in the full one."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor.data, tuple(slice(0, size) for size in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise AutomodelError(f"unexpected local shard shape {tuple(local.shape)} (expected {tuple(shape)})")
    return local.data, tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module ``name``: the same in every process and every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def init_module_by_module(model: nn.Module, seed: int, skip: Collection[int] = ()) -> list[str]:
    """Initialise every parameter not in ``skip`` (ids) as the definition in this module's docstring says.

    Returns the clean names of the parameters initialised. A parameter that neither the model's initialisation nor
    its module's ``reset_parameters()`` sets is an error (its constructor's value is gone on the meta device)."""
    slots = _parameter_slots(model)
    lora_owned = {id(p) for m in model.modules() if _is_lora_layer(m) for c in _LORA_CONTAINERS
                  if isinstance(getattr(m, c, None), nn.Module) for p in getattr(m, c).parameters()}
    modules = dict(model.named_modules())
    models = {prefix: m for prefix, m in modules.items() if callable(getattr(type(m), "_init_weights", None))}
    magnitudes = _dora_magnitudes(modules)
    lora_owned |= {id(param) for _, _, _, param in magnitudes}
    units = []  # (name, module, is a LoRA layer, {dotted name: parameter}), read before the stand-ins go in
    for name, module in modules.items():
        lora = _is_lora_layer(module)
        if lora:
            params = {f"{c}.{n}": p for c in _LORA_CONTAINERS if isinstance(getattr(module, c, None), nn.Module)
                      for n, p in getattr(module, c).named_parameters()}
        else:
            params = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in lora_owned}
        units.append((name, module, lora, params))
    done: set[int] = set(skip)
    initialised: list[str] = []
    with _meta_stand_ins(slots) as stand_ins:
        for name, module, lora, params in units:
            todo = {n: p for n, p in params.items() if id(p) not in done}
            if not todo:
                continue
            if lora:
                initialiser, fallback = _lora_initialiser(model, module, name), None
            else:
                initialiser, fallback = _module_initialiser(models, modules, module, name)
            _init_unit(slots, stand_ins, todo, initialiser, fallback, module_seed(seed, _seed_name(name, lora)),
                       clean_name(name))
            done.update(id(p) for p in todo.values())
            initialised += [clean_name(_join(name, n)) for n in todo]
    for name, layer, adapter, param in magnitudes:  # after the base weights, whose norms they are
        if id(param) not in done:
            _set_dora_magnitude(layer, param)
            initialised.append(clean_name(f"{name}.lora_magnitude_vector.{adapter}.weight"))
    return initialised


def _dora_magnitudes(modules: dict[str, nn.Module]) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(LoRA layer name, layer, adapter, magnitude parameter) of every DoRA adapter; DoRA on a layer other than a
    linear one (an embedding, a convolution, whose magnitudes peft computes otherwise) is refused."""
    found = []
    for name, layer in modules.items():
        for adapter, dora in getattr(layer, "lora_magnitude_vector", {}).items():
            if type(dora).__name__ != "DoraLinearLayer" or layer.get_base_layer().weight.ndim != 2:
                kind = type(layer.get_base_layer()).__name__
                raise AutomodelError(f"LoRA adapter '{adapter}' at '{clean_name(name)}': DoRA on its {kind} layer "
                                     "cannot be initialised on the meta device (on linear layers it can); leave the "
                                     "layer out of peft.target_modules or set peft.use_dora: false")
            found.append((name, layer, adapter, dora.weight))
    return found


def _set_dora_magnitude(layer: nn.Module, magnitude: nn.Parameter) -> None:
    """peft's DoRA magnitude: the L2 norm of each output row of the base weight (``lora_B`` is zero at the start).
    On sharded weights the norms are DTensor reductions, so each rank computes its own rows."""
    from torch.distributed.tensor import DTensor

    weight = layer.get_base_layer().weight
    rows = weight.T if getattr(layer, "fan_in_fan_out", False) else weight
    with torch.no_grad():
        norms = torch.linalg.vector_norm(rows, dim=1).to(rows.dtype)
        local, slices = local_slices(magnitude)
        if isinstance(norms, DTensor) and isinstance(magnitude, DTensor) and \
                norms.device_mesh == magnitude.device_mesh:
            local.copy_(norms.redistribute(magnitude.device_mesh, magnitude.placements).to_local())
        else:
            local.copy_((norms.full_tensor() if isinstance(norms, DTensor) else norms)[slices])


Slots = dict[int, list[tuple[nn.Module, str]]]  # a parameter's id -> every (module, attribute) holding it


def _parameter_slots(model: nn.Module) -> Slots:
    slots: Slots = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, attr))
    return slots


@contextlib.contextmanager
def _meta_stand_ins(slots: Slots) -> Iterator[dict[int, nn.Parameter]]:
    """Within the block every parameter is replaced by a meta-device stand-in of its full shape (tied ones share
    theirs): an initialiser that also writes other modules' parameters writes nothing (no memory, no random
    draws), so no loaded weight or other module's shard is overwritten. Yields parameter id -> stand-in."""
    originals = {key: [(module, attr, module._parameters[attr]) for module, attr in holders]
                 for key, holders in slots.items()}
    stand_ins = {}
    for key, holders in originals.items():
        param = holders[0][2]
        stand_ins[key] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                      requires_grad=param.requires_grad)
        for module, attr, _ in holders:
            module._parameters[attr] = stand_ins[key]
    try:
        yield stand_ins
    finally:
        for holders in originals.values():
            for module, attr, param in holders:
                module._parameters[attr] = param


def _init_unit(slots: Slots, stand_ins: dict[int, nn.Parameter], params: dict[str, nn.Parameter],
               initialiser: Callable[[], None], fallback: Callable[[], None] | None, seed: int, name: str) -> None:
    """Put full-size CPU tensors in ``params``' places, initialise them, copy each rank's slice into ``params``.

    ``initialiser`` runs with the generator seeded by ``seed``. Where it leaves a parameter unset, the unit is
    initialised again from the same seed as a CPU build would: ``fallback`` (the module's ``reset_parameters()``,
    which its constructor runs), then ``initialiser``."""
    scratch = {}
    for dotted, param in params.items():
        full = torch.full(param.shape, float("nan"), dtype=param.dtype) if param.dtype.is_floating_point \
            else torch.zeros(param.shape, dtype=param.dtype)
        scratch[dotted] = (param, nn.Parameter(full, requires_grad=param.requires_grad))
        for module, attr in slots[id(param)]:
            module._parameters[attr] = scratch[dotted][1]

    def unset() -> list[str]:
        return [dotted for dotted, (_, full) in scratch.items() if full.is_floating_point() and full.isnan().any()]

    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.random.default_generator.manual_seed(seed)
            initialiser()
            if fallback is not None and unset():
                torch.random.default_generator.manual_seed(seed)
                fallback()
                initialiser()
            for dotted in unset():
                owner = slots[id(scratch[dotted][0])][0][0]
                raise AutomodelError(f"'{clean_name(_join(name, dotted))}' ({type(owner).__name__}) is set neither "
                                     "by the model's _init_weights (of its module or of a module holding it) nor by "
                                     "a reset_parameters() of its module, so it cannot be initialised on the meta "
                                     "device; load it from a checkpoint or build the model without meta-device "
                                     "initialisation")
            for param, full in scratch.values():
                local, slices = local_slices(param)
                local.copy_(full.data[slices] if slices else full.data)
    finally:
        for param, _ in scratch.values():
            for module, attr in slots[id(param)]:
                module._parameters[attr] = stand_ins[id(param)]


def _seed_name(name: str, lora: bool) -> str:
    """What a module's generator is seeded by: its name in the base model (peft's wrapping removed, so a LoRA run
    starts from the plain model's weights); a LoRA layer's adapters draw from a stream of their own."""
    base = clean_name(name).removeprefix("base_model.model.").replace(".base_layer", "")
    return f"{base}#lora" if lora else base


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "reset_lora_parameters") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _module_initialiser(models: dict[str, nn.Module], modules: dict[str, nn.Module], module: nn.Module,
                       name: str) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """What initialises ``module``'s own parameters: transformers' order (``_init_weights`` applied to every module,
    children before their parent, each module by the innermost model holding it), restricted to ``module`` and the
    modules holding it, since a parent's ``_init_weights`` may set its children's parameters (CLIP's attention sets
    its projections); and its ``reset_parameters()`` as the fallback."""
    path = _self_and_ancestors(name)
    chain = []
    for index, ancestor in enumerate(path):
        holder = next((models[prefix] for prefix in path[index:] if prefix in models), None)
        if holder is not None:
            chain.append((holder, modules[ancestor]))
    fallback = getattr(module, "reset_parameters", None)
    if not chain and fallback is None:
        raise AutomodelError(f"'{clean_name(name)}' ({type(module).__name__}) has parameters but neither an "
                             "_init_weights of its model nor reset_parameters() to initialise them")

    def initialise() -> None:
        for holder, target in chain:
            holder._init_weights(target)

    return initialise, fallback


def _self_and_ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a", ""]``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _lora_initialiser(model: nn.Module, layer: nn.Module, name: str) -> Callable[[], None]:
    """peft's own initialisation of a LoRA layer's adapters (those that need no base weights)."""
    configs = getattr(model, "peft_config", {})
    adapters = list(layer.lora_A.keys()) + list(getattr(layer, "lora_embedding_A", {}).keys())
    modes = {}
    for adapter in adapters:
        config = configs.get(adapter)
        mode = getattr(config, "init_lora_weights", True)
        dora = getattr(config, "use_dora", False)
        if mode not in _LORA_INITS or (dora and mode is False):
            what = f"init_lora_weights={mode!r}" + (" with DoRA" if dora else "")
            raise AutomodelError(f"LoRA adapter '{adapter}' at '{clean_name(name)}': {what} computes the adapter "
                                 "from the full base weights, which meta-device initialisation never holds; use "
                                 "init_lora_weights true or 'gaussian'")
        modes[adapter] = mode

    def initialise() -> None:
        for adapter, mode in modes.items():
            layer.reset_lora_parameters(adapter, mode)

    return initialise
