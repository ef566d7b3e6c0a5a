"""One train step on a 2x2x2 simulated mesh (data x fsdp x tensor) equals the same step on one
device; gradient accumulation over micro-batches equals the full-batch step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from prove_jax.data import pipeline as data_lib
from prove_jax.models import params as params_lib
from prove_jax.models import sharding
from prove_jax.training import step as ts
from prove_jax.training.objectives import make_loss_fn
from prove_jax.models.config import ModelConfig
from prove_jax.training.optimizer import make_optimizer
from prove_jax.training.config import OptimizerConfig
from tests.tokenizers_fixture import make_tokenizer, stdlib_text

CFG = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10000.0, mask_token_id=300)


def _real_batch():
    """8 rows of 32 tokens of stdlib source, some right-padded: the data pipeline's output."""
    tok = make_tokenizer(300)
    lines = [ln for ln in stdlib_text(("textwrap",)).splitlines() if ln.strip()]
    examples = [{"text": ln} for ln in lines[:64]]
    it = data_lib.make_dataset(examples, tok, max_length=32, block_size=4, global_batch_size=8,
                               seed=0, pack=False, process_index=0, process_count=1)
    batch = next(it)
    assert not batch["valid"].all()  # padding is exercised
    return batch


@functools.lru_cache(maxsize=1)
def _initial_params():
    """One random init (numpy), shared by every run so only the step is compared."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(params_lib.create_model(CFG, seed=0))))


def _jitted_step(mesh_shape, objective="mars", grad_accum=1, remat=False, dtype="float32"):
    """(mesh, optimizer, state layout, jitted train step) on the first devices of `mesh_shape`."""
    devices = jax.devices()[:int(np.prod(mesh_shape))]
    mesh = sharding.make_mesh(mesh_shape, devices=devices)
    tx = make_optimizer(OptimizerConfig(lr=1e-3, eps=1e-6, warmup_ratio=0.0), total_steps=10)
    layout = ts.state_layout(params_lib.abstract_model(CFG.replace(dtype=dtype), remat), tx, mesh)
    loss_fn = make_loss_fn(objective, block_size=4, mask_token_id=CFG.mask_token_id)
    step = ts.jit_step(ts.build_step_fn(layout.graphdef, tx, loss_fn, grad_accum), layout, mesh)
    return mesh, tx, layout, step


@functools.lru_cache(maxsize=None)
def _one_step(mesh_shape, objective, grad_accum=1, remat=False, dtype="float32"):
    mesh, tx, layout, step = _jitted_step(mesh_shape, objective, grad_accum, remat, dtype)
    model = nnx.merge(layout.graphdef, jax.tree.map(np.copy, _initial_params()))
    state = ts.init_state(model, tx, layout)
    with jax.set_mesh(mesh):
        batch = data_lib.to_global_batch(_real_batch(), mesh, ts.BATCH_SPEC)
        state, metrics = step(state, batch)
    return state, jax.tree.map(np.asarray, metrics)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)))


def test_sharded_step_equals_single_device_step():
    single, m1 = _one_step((1, 1, 1), "mars")
    sharded, m8 = _one_step((2, 2, 2), "mars")
    # the 8-device state really is split: weights over fsdp x tensor, moments alike
    q = sharded["params"]["layers"][0]["attn"]["q_kernel"]
    assert q.sharding.spec == P("tensor", None, "fsdp") and len(q.sharding.device_set) == 8
    assert q.addressable_shards[0].data.shape == (2, 8, 16)
    mu = sharded["opt_state"][1][0].mu["layers"][0]["attn"]["q_kernel"]
    assert mu.sharding.spec == P("tensor", None, "fsdp")
    for key in ("loss", "loss_masked", "loss_clean", "grad_norm", "masked_acc_by_pos"):
        np.testing.assert_allclose(m8[key], m1[key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert _max_diff(sharded["params"], single["params"]) < 2e-5
    assert _max_diff(sharded["opt_state"], single["opt_state"]) < 1e-6


def test_grad_accumulation_equals_full_batch():
    full, m_full = _one_step((2, 2, 2), "mars", grad_accum=1)
    accum, m_acc = _one_step((2, 2, 2), "mars", grad_accum=2)
    # per-sequence means over equal micro-batches average to the full-batch mean
    np.testing.assert_allclose(m_acc["loss"], m_full["loss"], rtol=1e-5)
    for key in ("loss_masked", "loss_clean", "grad_norm"):
        np.testing.assert_allclose(m_acc[key], m_full[key], rtol=1e-5, err_msg=key)
    for key in ("tokens", "sequences"):  # counts add up over micro-batches
        assert float(m_acc[key]) == float(m_full[key]) > 0, key
    assert _max_diff(accum["params"], full["params"]) < 2e-5


def test_grad_accumulation_sums_bf16_gradients_in_float32():
    """With bfloat16 parameters the micro-batch gradients are bf16; summed in bf16, 256 + 1 + 1 + 1
    is 256 (bf16 keeps 8 significant bits), so accumulation drops small micro-batches' gradients.
    One bf16 weight w, loss w * x per micro-batch: the mean gradient is mean(x) = 64.75."""
    import optax

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((), jnp.bfloat16))

    graphdef, state = nnx.split(Scale())
    loss_fn = lambda model, micro: ((model.w * micro["x"]).sum().astype(jnp.float32), {})
    step = ts.build_step_fn(graphdef, optax.sgd(0.0), loss_fn, grad_accum=4)
    params = nnx.to_pure_dict(state)
    state = {"params": params, "opt_state": optax.sgd(0.0).init(params), "step": jnp.int32(0)}
    x = jnp.array([[256.0], [1.0], [1.0], [1.0]], jnp.bfloat16)
    _, metrics = jax.jit(step)(state, {"x": x})
    # 64.75 is not a bf16 number: the float32 mean rounds to 64.5 or 65; the bf16 sum gives 64
    assert abs(float(metrics["grad_norm"]) - 64.75) <= 0.25, float(metrics["grad_norm"])


def test_remat_and_bf16_compute_options():
    base, m_base = _one_step((1, 1, 1), "mars")
    remat, m_remat = _one_step((1, 1, 1), "mars", remat=True)
    # rematerialisation recomputes the same forward: same loss and update. The two programs sum
    # the gradients in different orders; where a gradient is below Adam's eps (1e-6, e.g. rare
    # embedding rows) that rounding reaches the update, up to ~1e-3 of one step of lr 1e-3.
    np.testing.assert_allclose(m_remat["loss"], m_base["loss"], rtol=1e-6)
    assert _max_diff(remat["params"], base["params"]) < 3e-6
    bf16, m_bf16 = _one_step((1, 1, 1), "mars", dtype="bfloat16")
    # bf16 matmuls, float32 master weights and optimizer moments
    leaves = jax.tree.leaves(bf16["params"]) + jax.tree.leaves(bf16["opt_state"][1][0].mu)
    assert {str(x.dtype) for x in leaves} == {"float32"}
    np.testing.assert_allclose(m_bf16["loss"], m_base["loss"], rtol=2e-2)
    assert _max_diff(bf16["params"], base["params"]) < 5e-3


def test_a_mesh_whose_hosts_share_batch_rows_is_refused():
    """Each host feeds its own rows; with the hosts split only along the tensor axis they would
    hold different rows for one replicated shard. Two hosts are simulated on the 8 CPU devices
    (devices 0-3 on host 0, 4-7 on host 1), laid out as make_mesh lays them."""
    import jax
    from prove_jax.models.sharding import make_mesh
    from prove_jax.training.config import TrainConfigError
    from prove_jax.training.mesh import check_hosts_split_the_batch
    host = lambda d: d.id // 4
    for shape in ((2, 1, 4), (1, 2, 4), (8, 1, 1), (2, 2, 2)):  # hosts along data / fsdp: fine
        check_hosts_split_the_batch(make_mesh(shape, devices=jax.devices()), host)
    for shape in ((1, 1, 8),):
        with pytest.raises(TrainConfigError, match="does not split the batch across the 2 processes"):
            check_hosts_split_the_batch(make_mesh(shape, devices=jax.devices()), host)
    check_hosts_split_the_batch(make_mesh((1, 1, 8), devices=jax.devices()))  # one host: anything goes


@pytest.mark.parametrize("mesh_shape", [(2, 2, 1), (2, 2, 2)])
def test_no_collective_moves_activations_between_batch_shards(mesh_shape, capfd):
    """Rows split over data x fsdp stay on their devices through the whole step. The embedding
    lookup once gathered the table's rows still split over fsdp along hidden, so its output was
    split over fsdp twice (rows and hidden): GSPMD warned "Involuntary full rematerialization"
    and all-gathered the global [8, 64, hidden] batch of activations onto every device (at pod
    scale, gigabytes per chip)."""
    import re
    mesh, _, layout, step = _jitted_step(mesh_shape)
    rows, length = 8, 32  # the mars objective runs clean + masked copies: 64 positions
    with jax.set_mesh(mesh):
        hlo = step.lower(layout.abstract, ts.abstract_batch(mesh, rows, length)).compile().as_text()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    collectives = re.findall(
        r"= \w+\[([\d,]+)\][^ ]* (?:all-gather|all-reduce|all-to-all|collective-permute)\(", hlo)
    assert collectives  # the weights' all-gathers: the pattern reads this HLO
    # rank-3 results with 64 positions are activations (no weight has that shape)
    activations = [[int(d) for d in dims.split(",")] for dims in collectives]
    activations = [dims for dims in activations if len(dims) == 3 and dims[1] == 2 * length]
    rows_per_device = rows // sharding.batch_shards(mesh)
    assert all(dims[0] <= rows_per_device for dims in activations), activations
