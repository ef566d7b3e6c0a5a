"""`matmul.dense`: every matmul form computes the same thing, and each is used where it should be;
each `ComputeOptions` compiles its own program; checkpoints of the old [in, out] kernel layout, or
missing a weight, are refused by name. (That the input-major weight transpose stays out of the
decode loop is tests/decoding/test_decode_in_place.py.)"""

import copy
import functools
import os
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.checkpoints.checkpoint import (CheckpointError, load_model, params_pure_dict,
                                              save_params)
from prove_jax.models import matmul
from prove_jax.models.attention import causal_mask
from prove_jax.models.config import ModelConfig
from prove_jax.models.compute import (CPU_DECODE_MAX_ROWS, DEFAULT_COMPUTE, MATMUL_FORM_ENV, MATMUL_FORMS,
                                      ComputeOptions, ComputeOptionsError)
from prove_jax.models.matmul import dense
from prove_jax.models.params import create_model

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (jnp functions are jitted) included."""
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


def _has_barrier(fn, *args) -> bool:
    return "optimization_barrier" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("x_shape,w_shape,n_in", [
    ((3, 5, 16), (4, 6, 16), 1),  # q/k/v: [B, T, D] x [N, Dh, D]
    ((2, 7, 4, 6), (16, 4, 6), 2),  # o: [B, T, H, Dh] x [D, H, Dh]
    ((1, 1, 16), (40, 16), 1),  # one AR row, mlp
    ((2, 3, 16), (40, 16), 1),  # 6 rows: padded to 8 in the weight-major form
])
def test_matmul_forms_agree_values_and_gradients(x_shape, w_shape, n_in):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    axes = (tuple(range(len(x_shape) - n_in, len(x_shape))), tuple(range(len(w_shape) - n_in, len(w_shape))))
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64), axes=axes)
    results = {}
    for form in MATMUL_FORMS:
        compute = ComputeOptions(matmul_form=form, matmul_max_rows=10_000)
        loss = lambda x, w: jnp.sum(jnp.sin(dense(x, w, n_in, compute=compute)))  # noqa: E731
        assert _has_barrier(lambda x, w: dense(x, w, n_in, compute=compute), x, w) == (form != "plain")
        out = dense(x, w, n_in, compute=compute)
        grads = jax.grad(loss, argnums=(0, 1))(x, w)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
        results[form] = grads
    for form in MATMUL_FORMS:
        for a, b in zip(results[form], results["plain"]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,want", [(1, 1), (4, 4), (5, 8), (8, 8), (10, 16), (16, 16), (29, 32)])
def test_weight_major_rows_are_padded_to_whole_tiles(rows, want):
    assert matmul.padded_dot_rows(rows) == want
    # the benchmarks' side-by-side switch
    assert matmul.padded_dot_rows(rows, ComputeOptions(pad_dot_rows=False)) == rows
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((1, rows, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    compute = ComputeOptions(matmul_form="weight_major")
    jaxpr = jax.make_jaxpr(lambda x, w: dense(x, w, compute=compute))(x, w).jaxpr
    out = dense(x, w, compute=compute)
    pads = [e.outvars[0].aval.shape for e in _eqns(jaxpr) if e.primitive.name == "pad"]
    assert pads == ([] if want == rows else [(want, 16)])
    assert out.shape == (1, rows, 40)  # the zero rows are cut off again
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(w).T, rtol=1e-5, atol=1e-5)


def test_cpu_default_form_is_used_for_decode_rows_only(monkeypatch):
    assert jax.default_backend() == "cpu"
    monkeypatch.delenv(MATMUL_FORM_ENV, raising=False)
    compute = ComputeOptions()
    form, limit = matmul.decode_matmul_form(compute)
    assert form == "weight_major"
    assert limit == CPU_DECODE_MAX_ROWS
    w = jnp.ones((8, 16))
    decode = functools.partial(dense, compute=compute)
    assert _has_barrier(decode, jnp.ones((2, limit // 2, 16)), w)  # a decode step's rows
    assert not _has_barrier(decode, jnp.ones((2, limit, 16)), w)  # prefill / training rows
    monkeypatch.setenv(MATMUL_FORM_ENV, "plain")  # the override for other CPUs
    # read on the host when options are made, never while tracing: options made before the
    # change keep their form, and the new ones differ from them (so they key another program)
    assert matmul.decode_matmul_form(compute) == ("weight_major", limit)
    assert _has_barrier(decode, jnp.ones((2, 3, 16)), w)
    overridden = ComputeOptions()
    assert overridden != compute and overridden.cpu_matmul_form == "plain"
    assert matmul.decode_matmul_form(overridden) == ("plain", limit)
    assert not _has_barrier(functools.partial(dense, compute=overridden), jnp.ones((2, 3, 16)), w)
    monkeypatch.setenv(MATMUL_FORM_ENV, "fastest")
    with pytest.raises(ValueError, match=r"PROVE_JAX_CPU_MATMUL='fastest'.*weight_major, input_major, plain"):
        ComputeOptions()
    monkeypatch.delenv(MATMUL_FORM_ENV)
    with pytest.raises(ValueError, match="unknown matmul form 'transposed'"):
        ComputeOptions(matmul_form="transposed")


def test_bad_cpu_matmul_env_is_one_error_line_not_an_import_failure(tmp_path):
    """A bad PROVE_JAX_CPU_MATMUL is a ComputeOptionsError where options are made or used: the
    package still imports (DEFAULT_COMPUTE holds it unchecked), and the CLI prints one line."""
    held = ComputeOptions(cpu_matmul_form="fastest")  # what DEFAULT_COMPUTE is under that env
    with pytest.raises(ComputeOptionsError, match=r"PROVE_JAX_CPU_MATMUL='fastest'.*weight_major"):
        held.decode_form()
    with pytest.raises(ComputeOptionsError, match="PROVE_JAX_CPU_MATMUL='fastest'"):
        jax.make_jaxpr(functools.partial(dense, compute=held))(jnp.ones((1, 3, 16)), jnp.ones((8, 16)))
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    env = {**os.environ, MATMUL_FORM_ENV: "fastest", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "prove_jax.cli.main", "generate", "--input", "in.jsonl",
                          "--output", "out.jsonl"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: PROVE_JAX_CPU_MATMUL='fastest': choose one of weight_major, input_major, plain"]
    assert not (tmp_path / "out.jsonl").exists()


def test_platform_picks_the_form_it_compiles_for(monkeypatch):
    """`ComputeOptions.platform` is honoured while tracing: options for a TPU traced on this CPU
    take the accelerator's plain form (no barrier), whatever the CPU default; `resolve` spells
    the same choice out on the host."""
    monkeypatch.setenv(MATMUL_FORM_ENV, "input_major")
    x, w = jnp.ones((1, 3, 16)), jnp.ones((8, 16))
    for platform, form in (("tpu", "plain"), ("gpu", "plain"), ("cpu", "input_major")):
        compute = ComputeOptions(platform=platform)
        assert compute.decode_form()[0] == form
        assert _has_barrier(functools.partial(dense, compute=compute), x, w) == (form != "plain")
        resolved = compute.resolve()
        assert (resolved.platform, resolved.matmul_form) == (platform, form)
        assert resolved.decode_form()[0] == form
    assert ComputeOptions().resolve("tpu").matmul_form == "plain"
    assert ComputeOptions(matmul_form="weight_major").resolve("tpu").matmul_form == "weight_major"
    assert ComputeOptions().resolve().platform == jax.default_backend()


def test_model_logits_equal_in_every_form():
    model = create_model(CFG, seed=1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    logits = {}
    for form in MATMUL_FORMS:
        compute = ComputeOptions(matmul_form=form)
        logits[form] = np.asarray(model(tokens, positions, causal_mask(2, 9), compute=compute)[0])
    for form in MATMUL_FORMS:
        np.testing.assert_allclose(logits[form], logits["plain"], rtol=1e-5, atol=1e-5)


def test_two_kernel_options_compile_two_programs():
    """`compute` is static in a jit: two options in one process are two programs (not a reuse of
    whichever traced first) computing the same logits; equal options share one."""
    graphdef, state = nnx.split(create_model(CFG, seed=2))
    traces = []

    @functools.partial(jax.jit, static_argnames="compute")
    def forward(state, tokens, positions, mask, compute=DEFAULT_COMPUTE):
        traces.append(compute)
        return nnx.merge(graphdef, state)(tokens, positions, mask, compute=compute)[0]

    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (1, 3)), jnp.int32)
    args = (state, tokens, jnp.arange(3)[None], causal_mask(1, 3))
    hlo, logits = {}, {}
    for form in ("weight_major", "plain"):
        compute = ComputeOptions(matmul_form=form)
        hlo[form] = forward.lower(*args, compute=compute).as_text()
        logits[form] = np.asarray(forward(*args, compute=compute))
    assert hlo["weight_major"] != hlo["plain"]
    # each weight-major projection is one barrier more (the rotary tables have one in both)
    barriers = {form: text.count("stablehlo.optimization_barrier") for form, text in hlo.items()}
    assert barriers["weight_major"] > barriers["plain"], barriers
    np.testing.assert_allclose(logits["weight_major"], logits["plain"], rtol=1e-5, atol=1e-5)
    traced = len(traces)
    forward(*args, compute=ComputeOptions(matmul_form="plain"))  # an equal object: no new trace
    assert len(traces) == traced and {k.matmul_form for k in traces} == {"weight_major", "plain"}


def test_checkpoint_with_old_kernels_or_a_missing_weight_is_refused_by_name(tmp_path):
    params = jax.tree.map(np.asarray, params_pure_dict(create_model(CFG, seed=0)))
    old = copy.deepcopy(params)
    attn = old["layers"][0]["attn"]
    attn["q_kernel"] = np.transpose(attn["q_kernel"], (2, 0, 1))  # [D, H, Dh], as before
    save_params(str(tmp_path / "old"), old, CFG)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.q_kernel has shape \(32, 4, 8\).*"
                                              r"\(4, 8, 32\).*\[in, out\]"):
        load_model(str(tmp_path / "old"))
    missing = copy.deepcopy(params)
    del missing["layers"][1]["mlp"]
    save_params(str(tmp_path / "missing"), missing, CFG)
    with pytest.raises(CheckpointError, match=r"has no parameter layers\.1\.mlp\."):
        load_model(str(tmp_path / "missing"))
    save_params(str(tmp_path / "new"), params, CFG)
    restored = load_model(str(tmp_path / "new"))
    np.testing.assert_array_equal(np.asarray(restored.layers[0].attn.q_kernel[...]),
                                  params["layers"][0]["attn"]["q_kernel"])


def test_bfloat16_logits_and_attention_scores_accumulate_in_float32():
    """With bfloat16 weights and activations the LM head and the attention scores still come out
    of a float32 accumulation: equal to float64 arithmetic on the same bfloat16 inputs to float32
    precision, far inside bfloat16's rounding (rounded logits tie at the top ~2% of the time)."""
    from prove_jax.models.attention import _masked_scores
    cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    model = create_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.bfloat16)
    for form in MATMUL_FORMS:
        logits = model.logits(hidden, compute=ComputeOptions(matmul_form=form))
        assert logits.dtype == jnp.float32
        w = np.asarray(model.lm_head[...].astype(jnp.float32), np.float64)
        ref = np.asarray(hidden.astype(jnp.float32), np.float64) @ w.T
        np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-6)
        rounded = np.asarray(jnp.asarray(ref, jnp.bfloat16).astype(jnp.float32))
        assert np.abs(rounded - ref).max() > 100 * np.abs(np.asarray(logits) - ref).max()
    q = jnp.asarray(rng.standard_normal((1, 1, 4, 8)), jnp.bfloat16)  # [B, K, G*T, Dh], G=1
    keys = jnp.asarray(rng.standard_normal((1, 1, 6, 8)), jnp.bfloat16)
    scores = _masked_scores(q, keys, jnp.ones((1, 4, 6), bool), t=4, g=1)
    assert scores.dtype == jnp.float32
    ref = np.einsum("bkqd,bksd->bkqs", np.asarray(q.astype(jnp.float32), np.float64),
                    np.asarray(keys.astype(jnp.float32), np.float64)) * 8 ** -0.5
    np.testing.assert_allclose(np.asarray(scores), ref, rtol=1e-5, atol=1e-6)


def test_model_module_tables_are_read_only():
    """No module of `prove_jax.models` holds a mutable table (dict, list, set) at module level:
    a choice that changes a compiled program is an options field, never a table edited in place."""
    import importlib
    import pkgutil
    import prove_jax.models

    mutable = []
    for info in pkgutil.iter_modules(prove_jax.models.__path__):
        module = importlib.import_module(f"prove_jax.models.{info.name}")
        mutable += [f"{info.name}.{name}" for name, value in vars(module).items()
                    if not name.startswith("__") and type(value) in (dict, list, set, bytearray)]
    assert not mutable, mutable
