"""training/step.py: one train step is clipped AdamW, written out in numpy, on the gradient of
MARS's loss = CE(masked) + ar_weight x CE(clean) (docs/method.md section 2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from prove_jax.training import objectives
from prove_jax.models import params as params_lib
from prove_jax.models import sharding
from prove_jax.training import step as ts
from prove_jax.models.config import ModelConfig
from prove_jax.training.optimizer import make_optimizer
from prove_jax.training.config import OptimizerConfig


MASK_ID = 63


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10_000.0, mask_token_id=MASK_ID)


def _hand_batch():
    """4 rows of 16 tokens: SFT row (prompt 5), text row, a row whose only trained token is the
    first (no predecessor: no target), an SFT row with right padding."""
    rng = np.random.default_rng(5)
    ids = rng.integers(1, MASK_ID, size=(4, 16)).astype(np.int32)
    loss_mask = np.zeros((4, 16), bool)
    valid = np.ones((4, 16), bool)
    loss_mask[0, 5:] = True
    loss_mask[1, :] = True
    loss_mask[2, 0] = True
    loss_mask[3, 3:12], valid[3, 12:] = True, False
    ids[~valid] = 0
    return dict(input_ids=ids, loss_mask=loss_mask, valid=valid)


def _global_batch(batch, mesh):
    from prove_jax.data import pipeline as data_lib
    return data_lib.to_global_batch(batch, mesh, ts.BATCH_SPEC)


def test_train_step_is_clipped_adamw_on_the_weighted_mars_loss():
    """One step through the trainer's jitted step against AdamW written out in numpy. The
    gradient is taken independently (jax.grad of objectives.make_loss_fn); eps is large enough
    that the first Adam update depends on the clipped gradient's size, not only its sign."""
    opt = OptimizerConfig(lr=1e-2, warmup_ratio=0.0, min_lr_ratio=0.0, weight_decay=0.5, b1=0.8,
                          b2=0.95, eps=1e-4, clip_norm=0.05)
    ar_weight = 0.25
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    tx = make_optimizer(opt, total_steps=10)
    layout = ts.state_layout(params_lib.abstract_model(CFG), tx, mesh)
    model = params_lib.create_model(CFG, seed=2)
    p0 = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model)))
    batch = _hand_batch()

    # the oracle gradient, from the objective alone (not the train step)
    ref_fn = objectives.make_loss_fn("mars", block_size=4, mask_token_id=MASK_ID, ar_weight=ar_weight)
    graphdef, _ = nnx.split(model)
    g = jax.jit(jax.grad(lambda p, b: ref_fn(nnx.merge(graphdef, p), b)[0]))(
        nnx.to_pure_dict(nnx.state(model)), jax.tree.map(jnp.asarray, batch))
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
    # a row without any target (row 2) is not a sequence of the mean: dropping it changes nothing
    loss_of = jax.jit(lambda b: ref_fn(model, b)[0])
    without = {k: v[[0, 1, 3]] for k, v in batch.items()}
    np.testing.assert_allclose(float(loss_of(batch)), float(loss_of(without)), rtol=1e-6)

    state = ts.init_state(model, tx, layout)
    loss_fn = objectives.make_loss_fn("mars", block_size=4, mask_token_id=MASK_ID, ar_weight=ar_weight)
    step = ts.jit_step(ts.build_step_fn(layout.graphdef, tx, loss_fn), layout, mesh)
    with jax.set_mesh(mesh):
        state, metrics = step(state, _global_batch(batch, mesh))
    metrics = jax.tree.map(np.asarray, metrics)

    # the loss is CE(masked) + ar_weight x CE(clean), as configured
    np.testing.assert_allclose(metrics["loss"], metrics["loss_masked"] + ar_weight * metrics["loss_clean"],
                               rtol=1e-6)
    # counts: trained targets per stream, and rows that have any (row 2 has none)
    w = (batch["loss_mask"] & batch["valid"])[:, 1:]
    assert float(metrics["tokens"]) == w.sum() and float(metrics["sequences"]) == 3
    # grad_norm is the norm of the gradient (before clipping)
    g_norm = math.sqrt(sum(float((x ** 2).sum()) for x in jax.tree.leaves(g)))
    assert g_norm > 2 * opt.clip_norm, "pick clip_norm so that clipping is active"
    np.testing.assert_allclose(float(metrics["grad_norm"]), g_norm, rtol=1e-4)

    # AdamW, step 1: clip to clip_norm, moments, bias correction, decoupled weight decay
    gc = jax.tree.map(lambda x: x * min(1.0, opt.clip_norm / g_norm), g)
    mu = jax.tree.map(lambda x: (1 - opt.b1) * x, gc)
    nu = jax.tree.map(lambda x: (1 - opt.b2) * x * x, gc)
    lr0 = opt.lr  # warmup_ratio 0: one warmup step, at lr / 1
    p1 = jax.tree.map(lambda p, m, v: p - lr0 * ((m / (1 - opt.b1)) / (np.sqrt(v / (1 - opt.b2)) + opt.eps)
                                                 + opt.weight_decay * p), p0, mu, nu)
    got_mu = optax.tree.get(state["opt_state"], "mu")
    got_nu = optax.tree.get(state["opt_state"], "nu")
    for name, got, want in (("mu", got_mu, mu), ("nu", got_nu, nu), ("params", state["params"], p1)):
        # per leaf, relative to the leaf's largest value (float32 rounding; the bugs this
        # guards against are off by factors: the unclipped gradient is ~30x larger here)
        rel = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), 1e-30)),
                           got, want)
        assert max(jax.tree.leaves(rel)) <= 1e-5, (name, max(jax.tree.leaves(rel)))
    assert int(state["step"]) == 1
