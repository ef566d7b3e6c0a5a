"""The training forward's layer scan and remat policies (models/remat.py) change how the step is
compiled, never what it computes: the scanned model's logits and gradients equal the unrolled
one's, and every remat policy gives the loss and gradients of no remat, while saving different
residuals. Plus the config's policy names and the persistent compilation cache folder."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.models import params as params_lib
from prove_jax.models import sharding
from prove_jax.models.attention import causal_mask
from prove_jax.models.config import ModelConfig
from prove_jax.models.remat import REMAT_POLICIES, RematError, remat_name
from prove_jax.training.config import TrainConfigError
from tests.train_helpers import write_config

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10000.0)
B, T = 4, 16


@functools.lru_cache(maxsize=1)
def _inputs():
    """Random weights (biases and norms too, so no gradient is trivially zero) and a batch."""
    state = nnx.state(params_lib.create_model(CFG, seed=0))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    state = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape)
                                         for x, k in zip(leaves, keys)])
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    valid = jnp.arange(T)[None] < jnp.array([[T], [T - 3], [T], [5]])  # padded rows too
    return state, tokens, positions, causal_mask(B, T, valid)


def _loss_fn(remat: str, scan_layers: bool):
    graphdef = nnx.graphdef(params_lib.abstract_model(CFG, remat, scan_layers))
    _, tokens, positions, mask = _inputs()

    def loss(state):
        logits, cache = nnx.merge(graphdef, state)(tokens, positions, mask)
        assert cache is None
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits
    return loss


@functools.lru_cache(maxsize=None)
def _loss_logits_grads(remat: str, scan_layers: bool, mesh_shape=None):
    """(loss, logits, flat grads) of one forward + backward, on one device or a mesh."""
    state = _inputs()[0]
    fn = jax.jit(jax.value_and_grad(_loss_fn(remat, scan_layers), has_aux=True))
    if mesh_shape is None:
        (loss, logits), grads = fn(state)
    else:
        mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
        with jax.set_mesh(mesh):
            placed = jax.device_put(state, sharding.state_shardings(state, mesh))
            (loss, logits), grads = fn(placed)
    return float(loss), np.asarray(logits), {k: np.asarray(v) for k, v in params_lib.flat_params(grads).items()}


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
    loss, logits, grads = got
    np.testing.assert_allclose(loss, want[0], rtol=rtol)
    np.testing.assert_allclose(logits, want[1], rtol=rtol, atol=atol)
    assert grads.keys() == want[2].keys()
    for name in grads:
        np.testing.assert_allclose(grads[name], want[2][name], rtol=rtol, atol=atol, err_msg=name)


def test_the_scanned_layers_equal_the_unrolled_ones():
    unrolled = _loss_logits_grads("none", False)
    # gradients reach every layer's own parameters through the stack, none of them zero
    per_layer = [n for n in unrolled[2] if n.startswith("layers.")]
    assert len(per_layer) == CFG.num_layers * 12 and all(np.any(unrolled[2][n]) for n in per_layer)
    _assert_same(_loss_logits_grads("none", True), unrolled)


def test_the_scan_is_sharded_like_the_unrolled_layers():
    """On a data x fsdp x tensor mesh the stacked weights keep each layer's sharding (the
    "layers" axis replicated); the result is the one-device result."""
    _assert_same(_loss_logits_grads("dots", True, (2, 2, 2)), _loss_logits_grads("none", False))


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(policy, scan_layers):
    _assert_same(_loss_logits_grads(policy, scan_layers), _loss_logits_grads("none", False))


def _saved_residuals(policy: str, scan_layers: bool = False) -> list[str]:
    """What the backward pass keeps of the forward, one description per saved array."""
    from jax._src.ad_checkpoint import saved_residuals
    return [str(aval) for aval, _ in saved_residuals(lambda s: _loss_fn(policy, scan_layers)(s)[0],
                                                     _inputs()[0])]


def test_the_policies_keep_what_they_name():
    """full keeps the least, none the most; dots keeps every projection and attn_proj only the
    attention ones, so dots keeps more than attn_proj. A policy that is silently ignored (or two
    that mean the same) fails this."""
    kept = {p: _saved_residuals(p) for p in REMAT_POLICIES}
    total = {p: sum(_elements(aval) for aval in kept[p]) for p in kept}
    assert total["full"] < total["attn_proj"] < total["dots"] < total["none"], total
    # the scan keeps one stacked array per saved kind, not one per layer
    assert len(_saved_residuals("full", True)) < len(kept["full"])


def _elements(aval_text: str) -> int:
    """'f32[4,16,32]' -> 2048."""
    dims = aval_text[aval_text.index("[") + 1:aval_text.index("]")]
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def test_remat_policy_names_in_the_config(tmp_path):
    from prove_jax.training.config import load_config
    path = write_config(tmp_path)
    assert load_config(path).model.remat == "none" and not load_config(path).model.scan_layers
    for value, name in (("true", "full"), ("false", "none"), ("dots", "dots"), ("attn_proj", "attn_proj")):
        assert load_config(path, [f"model.remat={value}"]).model.remat == name
    with pytest.raises(TrainConfigError, match="model.remat must be one of none, full, dots, attn_proj "
                                                r"\(or true = full, false = none\), got 'everything'"):
        load_config(path, ["model.remat=everything"])
    with pytest.raises(RematError):
        remat_name("Full")
    with pytest.raises(TrainConfigError, match="model.scan_layers must be bool, got 'yes please'"):
        load_config(path, ["model.scan_layers=yes please"])
    cache_file = tmp_path / "a_file"
    cache_file.write_text("")
    with pytest.raises(TrainConfigError, match="compilation_cache_dir .* is a file"):
        load_config(path, [f"compilation_cache_dir={cache_file}"])


def test_the_compilation_cache_folder_receives_the_compiled_programs(tmp_path):
    from prove_jax.training.compile_cache import use_compilation_cache
    folder = tmp_path / "xla_cache"
    previous = use_compilation_cache(str(folder))
    try:
        assert jax.config.jax_compilation_cache_dir == str(folder)
        jax.jit(lambda x: jnp.sin(x) * 3.25 + jnp.float32(os.getpid() % 97))(jnp.ones(7)).block_until_ready()
        assert os.listdir(folder), "nothing was written to the cache folder"
    finally:
        use_compilation_cache(previous)
    assert use_compilation_cache(None) == previous  # None changes nothing



def test_a_scanned_rematerialised_run_trains_as_the_plain_one_and_fills_the_cache(tmp_path):
    """The loop builds its step from model.remat / model.scan_layers, and compiles through the
    configured cache folder."""
    from prove_jax.training.compile_cache import use_compilation_cache
    from prove_jax.training.loop import train
    from tests.train_helpers import tiny_config
    plain = train(tiny_config(tmp_path, "plain", steps=3, save_every=3), show_bar=False)
    cache = tmp_path / "xla_cache"
    previous = jax.config.jax_compilation_cache_dir
    try:
        scanned = train(tiny_config(tmp_path, "scanned", ["model.remat=dots", "model.scan_layers=true",
                                                           f"compilation_cache_dir={cache}"],
                                    steps=3, save_every=3), show_bar=False)
        assert os.listdir(cache), "the run compiled nothing into compilation_cache_dir"
    finally:
        use_compilation_cache(previous)
    assert plain.final_step == scanned.final_step == 3
    losses = lambda result: [r["loss"] for r in result.records]  # noqa: E731
    assert len(losses(plain)) == 3
    np.testing.assert_allclose(losses(scanned), losses(plain), rtol=1e-5)
