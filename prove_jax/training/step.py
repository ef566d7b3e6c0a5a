"""The jitted train step: loss + grads (with gradient accumulation) + one optimizer update.

The train state is a plain pytree `{"params", "opt_state", "step"}`, so it jits, donates and
checkpoints without NNX bookkeeping; the model is rebuilt from (graphdef, params) inside the
trace. Shardings come from the logical-axis table (models/sharding.py), so one step serves a
CPU, a simulated or multi-host mesh and --dry-run's AbstractMesh. Parameters stay in
`param_dtype` (float32 master weights) and are cast to `dtype` at each matmul.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax.models import sharding
from prove_jax.models.compute import DEFAULT_COMPUTE
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import abstract_model, abstract_sharded
from prove_jax.training.config import TrainConfig
from prove_jax.training.objectives import make_loss_fn
from prove_jax.training.optimizer import make_optimizer, opt_state_shardings

BATCH_SPEC = P(("data", "fsdp"))  # rows of every batch array are split over data x fsdp
LossFn = Callable  # (model, batch) -> (loss scalar, metrics dict): objectives.make_loss_fn
COUNT_METRICS = ("tokens", "sequences", "real_tokens")  # summed over micro-batches; others averaged
PACKED_KEYS = ("segment_ids", "positions")  # int32 [B, L] beside the others in packed batches


def batch_shardings(mesh, batch_keys=("input_ids", "loss_mask", "valid")) -> dict:
    return {k: NamedSharding(mesh, BATCH_SPEC) for k in batch_keys}


@dataclasses.dataclass
class StateLayout:
    """Abstract train state + its shardings: all a jit, a restore or a dry run needs."""
    graphdef: nnx.GraphDef
    abstract: dict  # ShapeDtypeStructs (with shardings) of {"params", "opt_state", "step"}
    shardings: dict  # NamedShardings, same tree


def state_layout(abstract_model, tx: optax.GradientTransformation, mesh) -> StateLayout:
    """Shardings of params (logical-axis table), optimizer moments (follow params), step."""
    graphdef, abs_params = abstract_sharded(abstract_model, mesh)
    param_sh = sharding.shardings_of(abs_params)
    opt_sh, abs_opt = opt_state_shardings(tx, abs_params, param_sh, mesh)
    shardings = {"params": param_sh, "opt_state": opt_sh, "step": NamedSharding(mesh, P())}
    abstract = {"params": abs_params, "opt_state": abs_opt,
                "step": jax.ShapeDtypeStruct((), jnp.int32)}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return StateLayout(graphdef, abstract, shardings)


def init_state(model, tx: optax.GradientTransformation, layout: StateLayout) -> dict:
    """Concrete train state from a concrete model, every array placed in its sharding."""
    params = nnx.to_pure_dict(nnx.state(model))
    params = jax.device_put(params, layout.shardings["params"])
    opt_state = jax.jit(tx.init, out_shardings=layout.shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), layout.shardings["step"])
    return {"params": params, "opt_state": opt_state, "step": step}


def _split_micro(x, n):
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each device's shard splits evenly."""
    if n == 1:
        return x[None]
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def accumulator_dtype(param_dtype) -> jnp.dtype:
    """dtype of the gradient sum over micro-batches: at least float32."""
    return jnp.promote_types(param_dtype, jnp.float32)


def gradient_update(loss_of: Callable, tx: optax.GradientTransformation, params, opt_state, batch,
                    grad_accum: int = 1):
    """One optimizer update of `params` on `batch`, the recipe of every trained thing here (the
    model's train step and the commit head's): `loss_of(params, batch) -> (loss, metrics)`,
    its gradients summed over `grad_accum` micro-batches, then `tx`. Returns (params, opt_state,
    grads, metrics), the metrics averaged over micro-batches (`COUNT_METRICS` summed)."""
    grad_of = jax.value_and_grad(loss_of, has_aux=True)
    if grad_accum == 1:
        (_, metrics), grads = grad_of(params, batch)
    else:
        micro_batches = jax.tree.map(lambda x: _split_micro(x, grad_accum), batch)

        def body(acc, micro):
            (_, m), g = grad_of(params, micro)
            g = jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc[0], g)
            return (g, jax.tree.map(jnp.add, acc[1], m)), None

        # float32 running sum even for bf16 params: bf16 drops addends below 1/256 of the total
        zero_g = jax.tree.map(lambda p: jnp.zeros(p.shape, accumulator_dtype(p.dtype)), params)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        zero_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                              jax.eval_shape(lambda: loss_of(params, first)[1]))
        (grads, metrics), _ = jax.lax.scan(body, (zero_g, zero_m), micro_batches)
        # equal-size micro-batches: the mean of their means is the full-batch mean
        grads = jax.tree.map(lambda g, p: (g / grad_accum).astype(p.dtype), grads, params)
        metrics = {k: (v if k in COUNT_METRICS else v / grad_accum) for k, v in metrics.items()}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads, metrics


def train_step(graphdef, tx: optax.GradientTransformation, loss_fn: LossFn, grad_accum: int,
               state: dict, batch: dict) -> tuple[dict, dict]:
    """(state, batch) -> (state, metrics): one `gradient_update` of the model rebuilt from
    (graphdef, params) inside the trace; metrics gain the gradient norm."""

    def loss_of(params, micro):
        return loss_fn(nnx.merge(graphdef, params), micro)

    params, opt_state, grads, metrics = gradient_update(
        loss_of, tx, state["params"], state["opt_state"], batch, grad_accum)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def build_step_fn(graphdef, tx, loss_fn: LossFn, grad_accum: int = 1):
    """`train_step` with its static parts bound: pure (state, batch) -> (state, metrics)."""
    return functools.partial(train_step, graphdef, tx, loss_fn, grad_accum)


def jit_step(step_fn, layout: StateLayout, mesh):
    """jax.jit with explicit in/out shardings; the input state is donated (updated in place)."""
    replicated = NamedSharding(mesh, P())
    # one sharding for every batch array, whichever keys the batch has (packed or not)
    return jax.jit(step_fn, in_shardings=(layout.shardings, NamedSharding(mesh, BATCH_SPEC)),
                   out_shardings=(layout.shardings, replicated), donate_argnums=(0,))


def configured_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh, platform: str | None = None):
    """(optimizer, state layout, jitted train step) of a config training `model_cfg` on `mesh`
    (a real or an abstract one): the one recipe the loop compiles and the dry run lowers. The
    forward's compute options are resolved here, on the host, for `platform` (None: this
    process's backend; the dry run's "tpu"), so that the step's trace reads fields only."""
    tx = make_optimizer(cfg.optimizer, cfg.steps)
    model = abstract_model(model_cfg, cfg.model.remat, cfg.model.scan_layers)
    layout = state_layout(model, tx, mesh)
    loss_fn = make_loss_fn(cfg.objective, block_size=cfg.block_size,
                           mask_token_id=model_cfg.mask_token_id, ar_weight=cfg.ar_weight,
                           compute=DEFAULT_COMPUTE.resolve(platform))
    step = build_step_fn(layout.graphdef, tx, loss_fn, cfg.optimizer.grad_accum)
    return tx, layout, jit_step(step, layout, mesh)


def abstract_batch(mesh, batch_size: int, length: int, packed: bool = False) -> dict:
    """The batch a train step takes, as ShapeDtypeStructs; `packed` adds PACKED_KEYS."""
    sh = NamedSharding(mesh, BATCH_SPEC)
    batch = {"input_ids": jax.ShapeDtypeStruct((batch_size, length), jnp.int32, sharding=sh),
             "loss_mask": jax.ShapeDtypeStruct((batch_size, length), jnp.bool_, sharding=sh),
             "valid": jax.ShapeDtypeStruct((batch_size, length), jnp.bool_, sharding=sh)}
    if packed:
        batch |= {k: jax.ShapeDtypeStruct((batch_size, length), jnp.int32, sharding=sh)
                  for k in PACKED_KEYS}
    return batch
