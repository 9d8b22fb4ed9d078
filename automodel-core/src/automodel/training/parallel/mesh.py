"""The device mesh: how the world's ranks split into pipeline, data, context and tensor parallel groups.

``distributed.*`` uses upstream's names: ``dp_size`` ('auto' | int: data-parallel ranks in all, replicate x shard),
``dp_replicate_size`` (HSDP replicas; FSDP2 shards within each), ``tp_size``, ``cp_size``, ``pp_size``. The mesh's
dimensions are always, in this order, ``pp, dp_replicate, dp_shard, cp, tp`` (size-1 dimensions included, so a
later tensor / context / pipeline parallel stage finds its dimension by name), plus the flattened ``dp`` dimension
(``dp_replicate x dp_shard``) that the data sampler and the loss reduction use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from automodel.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP = "dp"
PP = "pp"
CP = "cp"
_AUTO = ("auto", "none", None)
# distributed.* keys that size the layout (smallest_world's arguments)
LAYOUT_KEYS = ("dp_size", "dp_replicate_size", "tp_size", "cp_size", "pp_size", "ep_size")


@dataclass(frozen=True)
class MeshLayout:
    """A validated split of ``world_size`` ranks into the mesh's dimensions (row-major, ``tp`` fastest)."""

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: the sampler's replicas and the loss's reduction group."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on each dimension (the same row-major order ``init_device_mesh`` uses)."""
        coords = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.shape, strict=True))):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in MESH_DIMS}

    def seed_offset(self, rank: int) -> int:
        """What ``rng.ranked`` adds to ``rank``'s seed: the index of its tensor-parallel group, so that the ranks of
        one group draw alike (dropout, noise), as the activations they hold whole must stay the same on each; every
        other rank draws its own."""
        return rank // self.tp

    def dp_rank(self, rank: int) -> int:
        """``rank``'s index on the flattened ``dp`` dimension (which slice of the data it reads)."""
        where = self.coordinates(rank)
        return where["dp_replicate"] * self.dp_shard + where["dp_shard"]


def _as_size(value: Any, key: str, issues: list[ConfigIssue]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        issues.append(ConfigIssue(key, f"must be a positive integer, found {value!r}"))
        return None
    return value


def mesh_issues(world_size: int, dp_size: int | str | None = "auto", dp_replicate_size: int = 1, tp_size: int = 1,
                cp_size: int = 1, pp_size: int = 1, section: str = "distributed") -> list[ConfigIssue]:
    """Every problem with these sizes for ``world_size`` ranks, each under its dotted key."""
    return _plan(world_size, dp_size, dp_replicate_size, tp_size, cp_size, pp_size, section)[1]


def plan_mesh(world_size: int, dp_size: int | str | None = "auto", dp_replicate_size: int = 1, tp_size: int = 1,
              cp_size: int = 1, pp_size: int = 1, section: str = "distributed") -> MeshLayout:
    """The layout for ``world_size`` ranks; a ``ConfigError`` naming every wrong key otherwise."""
    layout, issues = _plan(world_size, dp_size, dp_replicate_size, tp_size, cp_size, pp_size, section)
    if issues:
        raise ConfigError(issues)
    return layout


def _plan(world_size: int, dp_size: Any, dp_replicate_size: Any, tp_size: Any, cp_size: Any, pp_size: Any,
          section: str) -> tuple[MeshLayout, list[ConfigIssue]]:
    issues: list[ConfigIssue] = []
    sizes = {name: _as_size(value, f"{section}.{name}", issues)
             for name, value in (("dp_replicate_size", dp_replicate_size), ("tp_size", tp_size),
                                 ("cp_size", cp_size), ("pp_size", pp_size))}
    if issues:
        return MeshLayout(world_size), issues
    replicate, tp, cp, pp = (sizes[n] for n in ("dp_replicate_size", "tp_size", "cp_size", "pp_size"))
    others = tp * cp * pp
    factors = f"tp_size ({tp}) * cp_size ({cp}) * pp_size ({pp})"
    if dp_size in _AUTO:
        if world_size % others:
            issues.append(ConfigIssue(f"{section}.dp_size", f"'{dp_size}' derives dp_size = world size / ({factors} "
                                      f"= {others}), but the world size {world_size} is not divisible by {others}; "
                                      "change the parallel sizes or the number of processes"))
            return MeshLayout(world_size), issues
        dp = world_size // others
    else:
        dp = _as_size(dp_size, f"{section}.dp_size", issues)
        if dp is None:
            return MeshLayout(world_size), issues
        if dp * others != world_size:
            issues.append(ConfigIssue(f"{section}.dp_size", f"{dp} * {factors} = {dp * others} ranks, but the run "
                                      f"has {world_size} (--nproc-per-node x --nnodes); set dp_size: auto or "
                                      "make the product equal the world size"))
            return MeshLayout(world_size), issues
    if dp % replicate:
        issues.append(ConfigIssue(f"{section}.dp_replicate_size", f"{replicate} does not divide dp_size ({dp}): HSDP "
                                  "needs dp_size = dp_replicate_size x (ranks each replica is sharded over)"))
        return MeshLayout(world_size), issues
    return MeshLayout(world_size, pp=pp, dp_replicate=replicate, dp_shard=dp // replicate, cp=cp, tp=tp), issues


def _size_or_one(value: Any) -> int:
    """A size as given, 1 where it is unset or malformed (validation reports a malformed one under its key)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def smallest_world(dp_size: Any = "auto", dp_replicate_size: Any = 1, tp_size: Any = 1, cp_size: Any = 1,
                   pp_size: Any = 1, ep_size: Any = 1, nodes: int = 1) -> int:
    """The fewest ranks a layout needs: ``dp_size x tp_size x cp_size x pp_size`` with a fixed ``dp_size``; with
    'auto' the smallest data-parallel size that ``dp_replicate_size`` divides and that makes ``dp x cp x tp`` a
    multiple of ``ep_size`` (experts shard over those ranks). With ``nodes`` (a run planned on that many machines)
    and ``dp_size`` 'auto': the smallest such world that splits evenly over them."""
    tp, cp, pp, ep = (_size_or_one(v) for v in (tp_size, cp_size, pp_size, ep_size))
    replicate, nodes = _size_or_one(dp_replicate_size), max(nodes, 1)
    if dp_size not in _AUTO:
        return _size_or_one(dp_size) * tp * cp * pp
    dp = replicate
    while (dp * cp * tp) % ep or (dp * tp * cp * pp) % nodes:
        dp += replicate
    return dp * tp * cp * pp


def build_device_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """The ``DeviceMesh`` of ``layout`` (every rank calls it: it creates one process group per dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten(DP)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, layout: MeshLayout) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard`` alone, or ``(dp_replicate, dp_shard)`` for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


def describe_mesh(layout: MeshLayout, max_ranks: int = 16) -> list[str]:
    """Lines for ``--dry-run``: the mesh's shape and where each rank sits (the first ``max_ranks`` of them)."""
    shape = " x ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, layout.shape, strict=True))
    kind = "HSDP" if layout.dp_replicate > 1 else "FSDP"
    over = f"dp_shard x cp = {layout.dp_shard * layout.cp}" if layout.cp > 1 else f"{layout.dp_shard}"
    lines = [f"device mesh: {shape} = {layout.world_size} ranks; data parallel dp = dp_replicate x dp_shard = "
             f"{layout.dp} ({kind} shards over {over})"]
    shown = min(layout.world_size, max_ranks)
    for rank in range(shown):
        where = ", ".join(f"{name} {index}" for name, index in layout.coordinates(rank).items())
        lines.append(f"  rank {rank}: {where} (dp {layout.dp_rank(rank)})")
    if shown < layout.world_size:
        lines.append(f"  ... {layout.world_size - shown} more ranks in the same pattern")
    return lines
