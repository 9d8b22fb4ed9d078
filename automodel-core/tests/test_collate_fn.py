"""Keys ending in ``_fn`` name a callable passed, not called: validation and the collate the loader gets."""

from __future__ import annotations

import functools

from automodel.config.schema import check_nested
from automodel.training.builders import collate_callable


def _issues(value, resolver, key="dataloader.collate_fn"):
    issues = []
    check_nested(value, key, resolver, issues)
    return [str(issue) for issue in issues]


def test_a_nested_fn_node_is_checked_without_its_first_parameter(resolver):
    # combine(left, right=None, items=()): `left` is the batch, supplied when the loader calls it
    assert _issues({"_target_": "amt_targets.combine", "right": 1}, resolver) == []
    found = _issues({"_target_": "amt_targets.combine", "rigth": 1}, resolver)
    assert len(found) == 1 and "rigth" in found[0] and "right" in found[0]


def test_a_node_that_is_not_under_an_fn_key_still_needs_every_argument(resolver):
    found = _issues({"_target_": "amt_targets.combine"}, resolver, key="dataloader.sampler")
    assert len(found) == 1 and "missing required argument 'left'" in found[0]


def test_a_top_level_fn_section_is_built_so_nothing_is_supplied(resolver):
    found = _issues({"_target_": "amt_targets.combine"}, resolver, key="kd_loss_fn")
    assert len(found) == 1 and "'left'" in found[0]


def test_a_function_gets_its_arguments_and_the_runtime_ones_it_names_bound(targets):
    fn = collate_callable(targets.combine, {"items": [1]}, {"right": "tokenizer", "processor": "unused"})
    assert isinstance(fn, functools.partial)
    assert fn("batch") == {"left": "batch", "right": "tokenizer", "items": [1]}
    assert collate_callable(targets.combine, {}, {"processor": "p"}) is targets.combine  # nothing to bind


def test_a_class_is_built_once_with_its_arguments_and_the_runtime_ones_it_names(targets):
    widget = collate_callable(targets.Widget, {"size": 3}, {"name": "from-runtime", "tokenizer": "unused"})
    assert isinstance(widget, targets.Widget) and (widget.size, widget.name) == (3, "from-runtime")
    assert collate_callable(targets.Widget, {"name": "given"}, {"name": "from-runtime"}).name == "given"
