"""Every jitted entry point resolves its compute options on the host: the decoder's program, the
train step, held-out evaluation, calibration's step timings and the commit-head step each trace
with `jax.default_backend` refusing to answer (a backend read while tracing keys no compile
cache, and in a multi-host job it would start the backend before the job joined)."""

import contextlib
import types

import jax
import numpy as np
import pytest

from prove_jax.data.pipeline import TokenizedRows
from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule
from prove_jax.decoding import program, step_timing
from prove_jax.evaluation import heldout
from prove_jax.models.attention import causal_mask
from prove_jax.models.params import create_model
from prove_jax.models.sharding import make_mesh
from prove_jax.training import commit_head_training as heads
from prove_jax.training import step as train_step
from tests.decode_helpers import CFG, random_prompts
from tests.train_helpers import tiny_config


class BackendRead(AssertionError):
    pass


@contextlib.contextmanager
def backend_refused_in(monkeypatch, module, name):
    """While `module.name` runs (a program's body: it runs while the program is traced),
    `jax.default_backend` raises BackendRead; outside it, the host may ask."""
    real_fn, real_backend, tracing = getattr(module, name), jax.default_backend, []

    def backend():
        if tracing:
            raise BackendRead(f"{name} read the backend while traced")
        return real_backend()

    def traced(*args, **kwargs):
        tracing.append(name)
        try:
            return real_fn(*args, **kwargs)
        finally:
            tracing.pop()

    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", backend)
        m.setattr(module, name, traced)
        yield traced


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


def test_the_guard_catches_a_forward_with_unresolved_options(model, monkeypatch):
    """The check below is live: a forward run with the default (unresolved) compute options
    asks for the backend while traced."""
    here = types.SimpleNamespace(forward=lambda m, t, p: m(t, p, causal_mask(1, t.shape[1]))[0])
    tokens = np.zeros((1, 4), np.int32)
    with backend_refused_in(monkeypatch, here, "forward") as forward:
        with pytest.raises(BackendRead):
            jax.jit(lambda t, p: forward(model, t, p)).trace(tokens, tokens)


def test_the_decoder_program_traces_without_the_backend(model, monkeypatch):
    decoder = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)))
    with backend_refused_in(monkeypatch, program, "run_program"):
        lowered = decoder.lower(random_prompts(), 8, batch_size=2)
    assert "while" in lowered.as_text()  # the decode loop was traced under the guard


def test_calibration_step_timings_trace_without_the_backend(model, monkeypatch):
    with backend_refused_in(monkeypatch, step_timing, "_run_steps"):
        runs = step_timing.decode_step_runs(model, 1, [], slots=32, filled=8, steps=1)
        assert all(run() > 0 for run in runs.values())


def test_heldout_evaluation_traces_without_the_backend(model, monkeypatch):
    ids = np.random.RandomState(0).randint(2, 90, (2, 12)).astype(np.int32)
    rows = TokenizedRows(ids, np.ones(ids.shape, bool), np.ones(ids.shape, bool), 0, 0)
    with backend_refused_in(monkeypatch, heldout, "heldout_sums"):
        metrics = heldout.heldout_metrics(model, rows, batch_size=2)
    assert np.isfinite(metrics["nll"]) and metrics["tokens"] > 0


def test_the_train_and_commit_head_steps_trace_without_the_backend(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, block_size=4, max_length=16, global_batch_size=2)
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    batch = train_step.abstract_batch(mesh, 2, 16)
    with backend_refused_in(monkeypatch, train_step, "train_step"):
        _, layout, step = train_step.configured_step(cfg, CFG, mesh)
        step.trace(layout.abstract, batch)
    tx = heads.head_optimizer(cfg)
    layout = heads.head_layout(CFG, CFG.replace(mask_token_id=None), tx, mesh)
    with backend_refused_in(monkeypatch, heads, "head_step"):
        step = heads.jit_head_step(cfg, layout, tx, mesh, CFG.mask_token_id)
        step.trace(layout.frozen, layout.state, batch)


def test_program_settings_made_for_another_backend_key_another_program(monkeypatch):
    """The compile cache's key holds the resolved compute options the trace reads: settings
    equal in every given field but resolved for another backend are another program."""
    options = DecodeOptions("ar").validate()

    def settings():
        return program.ProgramSettings(options=options, num_rows=1, num_slots=16, pad_id=0,
                                       mask_id=-1, prefill_chunk=4)
    here = settings()
    assert here == settings() and hash(here) == hash(settings())
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    elsewhere = settings()
    assert elsewhere.compute.platform == "tpu" != here.compute.platform
    assert elsewhere != here
