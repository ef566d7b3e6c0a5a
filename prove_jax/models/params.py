"""Building models: random init or abstract, sharded on a mesh, and flat dotted-path views."""

from __future__ import annotations

import functools
from typing import Mapping

import jax
from flax import nnx

from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig
from prove_jax.models.qwen2 import Qwen2


def abstract_model(cfg: ModelConfig, remat: str | bool = "none",
                   scan_layers: bool = False) -> Qwen2:
    """A Qwen2 whose parameters are ShapeDtypeStructs: no memory allocated. `remat` and
    `scan_layers` shape the training forward only (`Qwen2`); the parameters are the same."""
    return nnx.eval_shape(lambda: Qwen2(cfg, nnx.Rngs(0), remat=remat, scan_layers=scan_layers))


def abstract_sharded(abstract: Qwen2, mesh=None, rules: Mapping = sharding.DEFAULT_RULES
                     ) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, {name: ShapeDtypeStruct with its sharding}) of an abstract model's parameters:
    on `mesh` as the logical-axis rules place them, without one on the first device. What a
    jit, a restore, a conversion or a dry run needs, nothing allocated."""
    graphdef, state = nnx.split(abstract)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, nnx.to_pure_dict(state))
    else:
        shardings = sharding.state_shardings(state, mesh, rules)
        shardings = nnx.to_pure_dict(shardings) if isinstance(shardings, nnx.State) else shardings
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(state), shardings)
    return graphdef, placed


def create_model(cfg: ModelConfig, seed: int = 0, mesh=None,
                 rules: Mapping = sharding.DEFAULT_RULES, remat: str | bool = "none",
                 scan_layers: bool = False) -> Qwen2:
    """Random-init model; with a mesh, each parameter is created directly in its sharding."""
    if mesh is None:
        return Qwen2(cfg, nnx.Rngs(seed), remat=remat, scan_layers=scan_layers)
    graphdef, placed = abstract_sharded(abstract_model(cfg, remat, scan_layers), mesh, rules)

    @functools.partial(jax.jit, out_shardings=sharding.shardings_of(placed))
    def init():
        return nnx.to_pure_dict(nnx.state(Qwen2(cfg, nnx.Rngs(seed))))

    with jax.set_mesh(mesh):
        return nnx.merge(graphdef, init())


def dotted_path(path) -> str:
    """'layers.0.attn.q_kernel' for a jax tree path: dict and nnx keys, namedtuple fields and
    sequence indices alike ('opt_state.1.0.mu.embed'; orbax stores namedtuples as dicts, so a
    field name is the common form)."""
    def name(key) -> str:
        for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)
    return ".".join(name(k) for k in path)


def flat_params(model_or_state) -> dict[str, jax.Array]:
    """{'layers.0.attn.q_kernel': array, ...} for every nnx.Param."""
    state = model_or_state
    if not isinstance(state, nnx.State):
        state = nnx.state(model_or_state, nnx.Param)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        flat[dotted_path(path)] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    return flat


def param_logical_axes(model) -> dict[str, tuple]:
    state = nnx.state(model, nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        out[dotted_path(path)] = getattr(leaf, "logical_axes", None)
    return out


def set_flat_params(model, flat: Mapping[str, jax.Array]) -> None:
    """Assign arrays (already in our layout) to the model's parameters in place."""
    state = nnx.state(model, nnx.Param)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
    for path, var in leaves:
        name = dotted_path(path)
        var.set_value(flat[name])
    nnx.update(model, state)
