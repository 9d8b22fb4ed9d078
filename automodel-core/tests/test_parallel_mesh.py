"""The device-mesh layout from ``distributed.*`` sizes: validation, coordinates, the dry-run description.

The mesh itself is built on two gloo ranks in test_parallel_fsdp.py."""

from __future__ import annotations

import pytest

from automodel.errors import ConfigError
from automodel.training.parallel.mesh import MESH_DIMS, MeshLayout, describe_mesh, mesh_issues, plan_mesh


@pytest.mark.parametrize(("world", "sizes", "expected"), [
    (8, {}, MeshLayout(8, dp_shard=8)),
    (8, {"dp_size": "none"}, MeshLayout(8, dp_shard=8)),
    (8, {"dp_size": None, "dp_replicate_size": 2}, MeshLayout(8, dp_replicate=2, dp_shard=4)),
    (8, {"dp_size": 8, "dp_replicate_size": 8}, MeshLayout(8, dp_replicate=8, dp_shard=1)),
    (16, {"tp_size": 2, "pp_size": 2}, MeshLayout(16, pp=2, dp_shard=4, tp=2)),
    (12, {"dp_size": 3, "cp_size": 2, "tp_size": 2}, MeshLayout(12, dp_shard=3, cp=2, tp=2)),
    (1, {}, MeshLayout(1)),
])
def test_layout_from_upstream_sizes(world, sizes, expected):
    layout = plan_mesh(world, **sizes)
    assert layout == expected
    assert layout.dp == expected.dp_replicate * expected.dp_shard


@pytest.mark.parametrize(("world", "sizes", "key", "words"), [
    (8, {"dp_size": 3}, "distributed.dp_size", "3 * tp_size (1) * cp_size (1) * pp_size (1) = 3 ranks, but the run "
                                               "has 8"),
    (6, {"tp_size": 4}, "distributed.dp_size", "world size 6 is not divisible by 4"),
    (8, {"dp_replicate_size": 3}, "distributed.dp_replicate_size", "3 does not divide dp_size (8)"),
    (8, {"tp_size": 0}, "distributed.tp_size", "positive integer, found 0"),
    (8, {"dp_size": "many"}, "distributed.dp_size", "positive integer, found 'many'"),
    (8, {"pp_size": True}, "distributed.pp_size", "positive integer, found True"),
])
def test_wrong_sizes_name_their_key(world, sizes, key, words):
    with pytest.raises(ConfigError) as caught:
        plan_mesh(world, **sizes)
    assert [issue.key for issue in caught.value.issues] == [key]
    assert words in str(caught.value)
    assert mesh_issues(world, **sizes) == caught.value.issues


def test_every_wrong_size_is_reported_at_once():
    issues = mesh_issues(8, dp_replicate_size=0, cp_size=-1, section="parallel")
    assert [issue.key for issue in issues] == ["parallel.dp_replicate_size", "parallel.cp_size"]


def test_coordinates_are_row_major_with_tp_fastest():
    layout = MeshLayout(16, pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    assert layout.shape == (2, 2, 2, 1, 2)
    assert [layout.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert layout.coordinates(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert [layout.dp_rank(r) for r in (0, 2, 4, 6, 8)] == [0, 1, 2, 3, 0]
    assert sorted({tuple(layout.coordinates(r).values()) for r in range(16)}) == sorted(
        tuple(layout.coordinates(r).values()) for r in range(16))  # every rank a distinct place


def test_rng_ranked_seeds_the_ranks_of_one_tensor_parallel_group_alike():
    """rng.ranked offsets each rank's seed by its tensor-parallel group: the ranks holding the same activations whole
    (a draft recipe's draft, the replicated parts of a tensor-parallel model) draw the same noise and dropout."""
    tensor_parallel = MeshLayout(8, dp_shard=2, cp=2, tp=2)
    assert [tensor_parallel.seed_offset(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [MeshLayout(4, dp_shard=2, cp=2).seed_offset(r) for r in range(4)] == [0, 1, 2, 3]


def test_describe_names_each_rank_and_stops_at_a_limit():
    lines = describe_mesh(MeshLayout(4, dp_replicate=2, dp_shard=2))
    assert lines[0] == ("device mesh: pp 1 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 = 4 ranks; data parallel "
                        "dp = dp_replicate x dp_shard = 4 (HSDP shards over 2)")
    assert lines[1:] == [f"  rank {r}: pp 0, dp_replicate {r // 2}, dp_shard {r % 2}, cp 0, tp 0 (dp {r})"
                         for r in range(4)]
    many = describe_mesh(MeshLayout(64, dp_shard=64), max_ranks=3)
    assert "(FSDP shards over 64)" in many[0]
    assert "dp = dp_replicate x dp_shard = 2 (FSDP shards over dp_shard x cp = 4)" in describe_mesh(
        MeshLayout(4, dp_shard=2, cp=2))[0]  # context parallelism: FSDP2 over dp_shard x cp
    assert len(many) == 5 and many[-1] == "  ... 61 more ranks in the same pattern"
    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
