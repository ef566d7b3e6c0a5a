"""training/metrics.py: a training step's FLOPs worked out by hand, peak FLOPs by device kind,
and the step time, throughput and MFU a record reports."""

from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest

from prove_jax.training import metrics
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import abstract_model, flat_params


def _param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(v.shape)) for v in flat_params(abstract_model(cfg)).values())


@pytest.mark.parametrize("objective", ["mars", "ar"])
@pytest.mark.parametrize("tied", [False, True])
def test_train_flops_are_six_params_per_streamed_token_plus_attention(objective, tied):
    """MARS's doubled stream (2L positions) counts in the matmul and attention terms; the input
    embedding (a lookup) is not in 6N, a tied table (the LM head's matmul) is. By hand: 6 FLOPs per parameter per token (forward 2, backward 4); attention per layer and
    sequence is QK^T and AV, 2 x 2 x S^2 x heads x head_dim forward, 3x that with the backward."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
    batch, length = 5, 12
    s = 2 * length if objective == "mars" else length
    n = _param_count(cfg) - (0 if tied else 64 * 32)  # a tied table is the head: counted once
    want = 6 * n * batch * s + 3 * 4 * s * s * 4 * 8 * 3 * batch
    assert metrics.train_flops_per_step(cfg, batch, length, objective) == pytest.approx(want)


def test_peak_flops_are_found_in_real_device_kind_strings():
    """A table key is found inside the device kind string (not the other way round). Dense
    bf16 peaks from the vendors' data sheets."""
    for kind, peak in [("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("TPU v6 lite", 918e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12)]:
        assert metrics.peak_flops(kind) == peak, kind
    assert metrics.peak_flops("cpu") is None


def test_step_time_throughput_and_mfu_are_per_step_over_all_devices(tmp_path, monkeypatch):
    """The time since the last record is divided by the steps it covers, and MFU is over all
    the devices' peak, not one chip's."""
    clock = iter([100.0, 108.0, 109.5])
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(metrics, "peak_flops", lambda kind: 1e12)
    logger = metrics.MetricsLogger(str(tmp_path / "run"), total_steps=10, start_step=2, flops_per_step=6e12,
                                   tokens_per_step=512, show_bar=False)
    first = logger.record(6, {"loss": np.float32(2.5)})  # steps 3..6 in 8 s
    second = logger.record(7, {"loss": 2.0})
    devices = jax.device_count()
    for rec, dt in ((first, 2.0), (second, 1.5)):
        assert rec["step_time_s"] == pytest.approx(dt)
        assert rec["tokens_per_s"] == pytest.approx(512 / dt)
        assert rec["mfu"] == pytest.approx(6e12 / dt / (1e12 * devices))
    written = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in written] == [(6, 2.5), (7, 2.0)]
    assert written[0]["step_time_s"] == pytest.approx(2.0)


def test_throughput_and_mfu_count_real_tokens_only(tmp_path, monkeypatch):
    """Row padding counts neither as throughput nor as model FLOPs."""
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(metrics, "peak_flops", lambda kind: 1e12)
    logger = metrics.MetricsLogger(str(tmp_path / "run"), total_steps=10, flops_per_step=6e12,
                                   tokens_per_step=512, show_bar=False)
    rec = logger.record(1, {"loss": 2.0, "real_tokens": np.float32(384)})  # a quarter is padding
    assert rec["tokens_per_s"] == pytest.approx(384 / 2.0)
    assert rec["padding_fraction"] == pytest.approx(0.25)
    assert rec["mfu"] == pytest.approx(0.75 * 6e12 / 2.0 / (1e12 * jax.device_count()))
