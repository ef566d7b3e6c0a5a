"""training/optimizer.py: the learning-rate schedule is the warmup + cosine of its docstring
(docs/method.md: "cosine schedule, 3% warmup"), written out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prove_jax.training.optimizer import lr_schedule
from prove_jax.training.config import OptimizerConfig


def _expected_lr(step, lr, total, warmup_ratio, min_ratio):
    """optimizer.py's contract, by hand: linear warmup over w = max(1, round(ratio * total)) steps
    starting at lr / w (so the first update moves the weights) and reaching lr at step w, then
    cosine decay from lr at step w to lr * min_ratio at step `total`."""
    w = max(1, int(round(warmup_ratio * total)))
    if step < w:
        return lr / w + (lr - lr / w) * step / w
    frac = min(step - w, total - w) / max(1, total - w)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@pytest.mark.parametrize("total,warmup_ratio,min_ratio", [(100, 0.1, 0.1), (40, 0.0, 0.25), (7, 0.3, 0.0)])
def test_lr_schedule_is_warmup_then_cosine_to_the_floor(total, warmup_ratio, min_ratio):
    lr = 3e-3
    sched = lr_schedule(OptimizerConfig(lr=lr, warmup_ratio=warmup_ratio, min_lr_ratio=min_ratio), total)
    got = np.array([float(sched(s)) for s in range(total + 1)])
    want = np.array([_expected_lr(s, lr, total, warmup_ratio, min_ratio) for s in range(total + 1)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    w = max(1, int(round(warmup_ratio * total)))
    assert got[0] > 0 and np.isclose(got[w], lr) and np.isclose(got[total], lr * min_ratio, atol=1e-9)
