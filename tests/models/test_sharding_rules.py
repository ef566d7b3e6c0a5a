"""models/sharding.py's rules on a real mesh: a dimension keeps the longest prefix of its mesh
axes that divides it, shard shapes round up, and an axis without a rule is refused."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from prove_jax.models import sharding


def test_a_dimension_keeps_the_longest_prefix_of_its_mesh_axes_that_divides_it():
    """When the pair does not divide, the first axis is kept (not the last); the pair's size is
    the product of its axes."""
    mesh = sharding.make_mesh((2, 2, 2))
    for rows, want in [(8, P(("data", "fsdp"))), (4, P(("data", "fsdp"))), (6, P("data")), (2, P("data")),
                       (3, P())]:
        assert sharding.logical_to_spec(("batch", "sequence"), (rows, 16), mesh) == want, rows
    # batch takes data x fsdp, so embed (fsdp) must go unsplit: no mesh axis twice in one spec
    assert sharding.logical_to_spec(("batch", "sequence", "embed"), (8, 4, 32), mesh) == P(("data", "fsdp"))
    assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")


def test_shard_shape_rounds_an_uneven_split_up():
    """An uneven shard is rounded up, as XLA pads it (floor division would undercount)."""
    mesh_shape = {"data": 2, "fsdp": 2, "tensor": 2}
    assert sharding.shard_shape((5, 6, 7), P("tensor", ("data", "fsdp")), mesh_shape) == (3, 2, 7)
    assert sharding.shard_shape((8, 6), P(None, "fsdp"), mesh_shape) == (8, 3)
    assert sharding.shard_shape((1, 3), P(("data", "fsdp", "tensor")), mesh_shape) == (1, 3)


def test_a_logical_axis_without_a_rule_is_refused():
    """An unknown axis name raises rather than being silently replicated."""
    with pytest.raises(KeyError, match="'hiddn' has no sharding rule"):
        sharding.logical_to_spec(("batch", "hiddn"))
    with pytest.raises(KeyError, match="no sharding rule"):
        sharding.logical_to_spec(("hiddn",), (8,), sharding.make_mesh((2, 2, 2)))
