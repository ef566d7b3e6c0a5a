"""Logical-axis sharding: one table maps model axis names to mesh axes.

Every parameter carries `logical_axes` metadata (e.g. ("embed", "heads", "head_dim")). Changing
the parallelism means editing `DEFAULT_RULES`, nothing else. A dimension that the mesh axis does
not divide is replicated instead of failing, so size-1 axes and odd head counts always work.
Decoding's default mesh (`inference_mesh`) puts the tensor axis over the kv heads, as far as the
weights need, and the rest on data; its KV cache lies as `KV_CACHE_AXES` says, or split over
rows where the tensor axis cannot split a model's kv heads (`kv_rules`).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from prove_jax import memory
from prove_jax.errors import ProveJaxError

MESH_AXES = ("data", "fsdp", "tensor")


class MeshError(ProveJaxError, ValueError):
    """A mesh shape these devices cannot form."""

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated); read-only, as every
# module table: a layout is changed by passing other rules, never by editing these
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = MappingProxyType({
    "batch": ("data", "fsdp"),
    "sequence": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,  # whole on every device, so Qwen3's per-head q/k norm weights [Dh] are too
    "mlp": "tensor",
    "vocab": "tensor",
    "cache_sequence": None,
    "layers": None,
})

# A KV cache buffer [B, K, S, Dh]: rows split like the batch, kv heads like the k/v kernels, so
# each device writes and reads the keys and values it computes (models/attention.py).
KV_CACHE_AXES = ("batch", "kv_heads", "cache_sequence", "head_dim")

# Attention split over rows: for a model whose kv heads the tensor axis cannot split (a 3B
# verifier's 2 over tensor=8), whose cache would otherwise lie whole on every tensor device. Its
# rows' KV and attention split over the tensor axis too; its weights stay tensor-parallel, and
# the queries and outputs cross between the layouts by all-to-all (`kv_rules`,
# benchmarks/decode_tpu_compile.md).
ROW_SPLIT_RULES: Mapping[str, str | tuple[str, ...] | None] = MappingProxyType({
    **DEFAULT_RULES, "batch": ("data", "fsdp", "tensor"), "heads": None, "kv_heads": None})


def batch_shards(mesh, rules: Mapping = DEFAULT_RULES) -> int:
    """How many ways a batch's rows are split: over the mesh axes `rules["batch"]` names (data x
    fsdp by default)."""
    return _mesh_axis_size(mesh, _present(mesh, rules["batch"]))


def rows_per_device(rows: int, rules: Mapping = DEFAULT_RULES) -> int:
    """Rows of a traced `rows`-row batch that one device computes: the batch split over the
    mesh set with `jax.set_mesh` (all of them outside one, or when they do not split evenly,
    in which case the batch is replicated, see the module docstring)."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else batch_shards(mesh, rules)
    return rows // shards if rows % shards == 0 else rows


def kv_rules(num_kv_heads: int, rows: int, mesh=None) -> Mapping:
    """The rules a KV cache of `rows` rows and `num_kv_heads` heads, and the attention reading
    it, follow on `mesh` (default: the ambient one): `ROW_SPLIT_RULES` where the tensor axis
    does not divide the heads but data x fsdp x tensor divides the rows, else `DEFAULT_RULES`."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or not mesh.shape:
        return DEFAULT_RULES
    tensor = mesh.shape.get("tensor", 1)
    if tensor == 1 or num_kv_heads % tensor == 0:
        return DEFAULT_RULES
    return ROW_SPLIT_RULES if rows % batch_shards(mesh, ROW_SPLIT_RULES) == 0 else DEFAULT_RULES


def kv_per_device(num_kv_heads: int, rows: int, mesh) -> int:
    """(row, kv head) pairs of a `rows`-row cache one device of `mesh` holds, laid out as
    `kv_rules` says (a split that does not divide a dimension replicates it)."""
    shape = (rows, num_kv_heads)
    placed = activation_sharding(mesh, KV_CACHE_AXES[:2], shape, kv_rules(num_kv_heads, rows, mesh))
    return math.prod(placed.shard_shape(shape))


def make_mesh(shape: Sequence[int] | Mapping[str, int] = (1, 1, 1),
              axis_names: Sequence[str] = MESH_AXES, devices=None) -> Mesh:
    """A device mesh with Auto axis types (classic GSPMD propagation), stated explicitly.

    `shape` may contain one -1, filled with the remaining device count.
    """
    if isinstance(shape, Mapping):
        axis_names, shape = tuple(shape), tuple(shape.values())
    shape = list(shape)
    devices = jax.devices() if devices is None else devices
    if len(shape) != len(axis_names):
        raise MeshError(f"mesh shape {shape} does not match axis names {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise MeshError(f"mesh shape {shape} has more than one -1")
    if any(s < 1 and s != -1 for s in shape):
        raise MeshError(f"mesh shape {tuple(shape)}: every axis is >= 1 (or one -1: the rest)")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:  # else some devices would sit idle, unsaid
            raise MeshError(f"mesh shape {tuple(shape)}: {len(devices)} devices do not divide "
                            f"into {known} x N")
        shape[shape.index(-1)] = len(devices) // known
    n = math.prod(shape)
    if n > len(devices) or n <= 0:
        raise MeshError(f"mesh shape {tuple(shape)} needs {n} devices, {len(devices)} available")
    device_grid = np.asarray(devices[:n]).reshape(shape)
    return Mesh(device_grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_names))


# The inference mesh splits the weights over the tensor axis until they take at most this share
# of a device's memory: the rest holds the KV caches, the loop state and the activations.
INFERENCE_WEIGHT_SHARE = 0.5


# With the KV cache of the requested rows x buffer known, the weights and that cache together
# may take this share of a device's memory: the rest holds the step's activations and temporaries.
INFERENCE_FIT_SHARE = 0.9


def inference_tensor_size(num_kv_heads: int, num_devices: int, weight_bytes: int,
                          device_bytes: int | None, share: float = INFERENCE_WEIGHT_SHARE,
                          kv_bytes: int = 0) -> int:
    """Devices the tensor axis of the default inference mesh spans: the smallest common divisor
    of `num_kv_heads` and `num_devices` that leaves each device at most `share` of its
    `device_bytes` in weights (`weight_bytes` in all, split that many ways) and, with
    `kv_bytes` (the KV caches of every row decoded, in all), weights and its share of the cache
    within `INFERENCE_FIT_SHARE` of it. Short of that, the largest such divisor if the weights
    fit at all; 1 when the device memory is unknown.

    Only kv-head divisors: each device then holds whole kv heads with their query heads, and
    computes and caches their keys and values alone (a split head would be gathered per step).
    The cache splits over every device whatever the tensor size (kv heads on tensor, rows on
    data), so only the weights' share shrinks as tensor grows: a 32B proposer at 64 rows x 8k on
    v6e-8 holds 15.3 GiB of weights and 16 GiB of KV per chip at tensor=4, which does not fit
    31.25 GiB, and 7.6 GiB of weights at tensor=8, which does (benchmarks/decode_step_cost.md)."""
    if device_bytes is None or num_devices == 1:
        return 1
    sizes = [t for t in range(1, num_kv_heads + 1)
             if num_kv_heads % t == 0 and num_devices % t == 0]
    kv = kv_bytes / num_devices
    for t in sizes:
        if (weight_bytes / t <= share * device_bytes
                and weight_bytes / t + kv <= INFERENCE_FIT_SHARE * device_bytes):
            return t
    if weight_bytes / sizes[-1] <= device_bytes:
        return sizes[-1]
    raise MeshError(f"the weights ({weight_bytes / 2**30:.1f} GiB) do not fit {num_devices} "
                    f"devices of "
                    f"{device_bytes / 2**30:.1f} GiB even split {sizes[-1]} ways over their "
                    f"{num_kv_heads} kv heads: use more devices, a smaller --dtype, or an explicit "
                    f"--mesh with an fsdp axis (which gathers the weights on every step)")


def kv_cache_bytes(configs: Sequence, rows: int, slots: int, dtype: str = "float32") -> int:
    """Bytes of the contiguous KV caches of `rows` rows x `slots` slots for the models of
    `configs` (keys and values of every layer and kv head), in all devices together."""
    per_slot = sum(2 * c.num_layers * c.num_kv_heads * c.head_dim for c in configs)
    return per_slot * rows * slots * jnp.dtype(dtype).itemsize


def inference_mesh(configs: Sequence, dtype: str = "float32", devices=None,
                   device_bytes: int | None = None, kv_bytes: int = 0) -> Mesh | None:
    """The default mesh to decode the models of `configs` (the proposer first, then a verifier)
    on `devices` (default all, every host's): tensor parallelism over the proposer's kv heads
    as far as the weights (and `kv_bytes` of KV cache, `kv_cache_bytes`, when the rows and
    buffer are known) need to fit (`inference_tensor_size`), the rest on data. None on one
    device. `device_bytes`: memory per device (default: `device_memory`)."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) == 1:
        return None
    if device_bytes is None:
        device_bytes = device_memory(devices)
    weight_bytes = sum(c.num_params for c in configs) * jnp.dtype(dtype).itemsize
    tensor = inference_tensor_size(configs[0].num_kv_heads, len(devices), weight_bytes,
                                   device_bytes, kv_bytes=kv_bytes)
    return make_mesh((len(devices) // tensor, 1, tensor), devices=devices)


def device_memory(devices) -> int | None:
    """Bytes one of `devices` holds: an accelerator's allocator limit (the same on every host of
    a slice, so every host picks the same mesh), on CPU the host's free memory over its
    simulated devices, which share it; None if unknown."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    if local[0].platform == "cpu":
        free = memory.free_device_memory(local[0])
        return None if free is None else free // len(local)
    stats = local[0].memory_stats() or {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def _present(mesh, axis) -> tuple[str, ...]:
    """The mesh axes of a rule's target (None, a name or a tuple) that `mesh` has."""
    names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    return tuple(a for a in names if a in mesh.shape)


def _mesh_axis_size(mesh, axis) -> int:
    if axis is None:
        return 1
    names = (axis,) if isinstance(axis, str) else axis
    return math.prod(mesh.shape[a] for a in names)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh=None, rules: Mapping = DEFAULT_RULES) -> P:
    """PartitionSpec for an array with the given logical axes.

    With `shape` and `mesh`, a mesh axis that does not divide its dimension is dropped
    (replicated), and a mesh axis is never used twice in one spec.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        names = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        if mesh is not None:
            names = tuple(a for a in names if a in mesh.shape and a not in used)
            if shape is not None:
                # keep the longest prefix of mesh axes that divides the dimension
                while names and shape[i] % _mesh_axis_size(mesh, names):
                    names = names[:-1]
            names = tuple(a for a in names if mesh.shape[a] > 1) or names
        used.update(names)
        spec.append(None if not names else (names[0] if len(names) == 1 else names))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def shard_shape(shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's piece of an array of `shape` laid out by `spec` on a mesh of
    `mesh_shape` (a split dimension rounds up, as XLA pads uneven shards)."""
    out = list(shape)
    for i, axes in enumerate(spec):
        if axes is not None:
            names = (axes,) if isinstance(axes, str) else axes
            out[i] = math.ceil(out[i] / math.prod(mesh_shape[a] for a in names))
    return tuple(out)


def state_specs(state, mesh=None, rules: Mapping = DEFAULT_RULES):
    """Pure-dict pytree of PartitionSpecs for an nnx.State (concrete or abstract)."""
    def spec(v):
        axes = getattr(v, "logical_axes", None)
        if axes is None:
            return P()
        return logical_to_spec(axes, v.get_value().shape, mesh, rules)
    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state, mesh, rules: Mapping = DEFAULT_RULES):
    """NamedShardings with the same tree structure as `state`'s leaves."""
    specs = state_specs(state, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shardings_of(tree):
    """The sharding each array (or ShapeDtypeStruct) of `tree` carries, in the same tree: the
    in/out shardings a jit or a device_put takes from an abstract state."""
    return jax.tree.map(lambda a: a.sharding, tree)


def activation_sharding(mesh, logical_axes: Sequence[str | None], shape=None,
                        rules: Mapping = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def splits_evenly(logical_axis: str, size: int, rules: Mapping = DEFAULT_RULES) -> bool:
    """Whether the ambient mesh splits a dimension of `size` over every mesh axis (of more than
    one device) its logical axis' rule names; True without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not mesh.shape:
        return True
    return size % _mesh_axis_size(mesh, _present(mesh, rules.get(logical_axis))) == 0


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Mapping = DEFAULT_RULES):
    """with_sharding_constraint under the ambient mesh (`jax.set_mesh`); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not mesh.shape:
        return x
    if any(t != AxisType.Auto for t in mesh.axis_types):
        return x  # under Explicit axes the type system carries shardings itself
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh, rules))
