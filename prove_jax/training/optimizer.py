"""Optimizer: AdamW with linear warmup + cosine decay and global-norm clipping (optax).

Gradient accumulation happens inside the jitted train step (step.py), not as an optax wrapper,
so one update is one schedule step and one checkpointable step.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax.training.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup over `warmup_ratio * total_steps` (at least 1 step), then cosine decay.

    Warmup starts at lr / warmup (not 0) so the very first update already moves the weights.
    """
    warmup = max(1, int(round(cfg.warmup_ratio * total_steps)))
    decay = max(1, total_steps - warmup)
    return optax.join_schedules(
        [optax.linear_schedule(cfg.lr / warmup, cfg.lr, warmup),
         optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)],
        boundaries=[warmup])


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.clip_norm:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


def opt_state_shardings(tx: optax.GradientTransformation, abstract_params, param_shardings, mesh):
    """Shardings for the optimizer state: moments follow their parameter, counters replicated
    (`jax.eval_shape(tx.init, ...)` loses shardings; `optax.tree_map_params` restores them)."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract_state, param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding)), abstract_state
