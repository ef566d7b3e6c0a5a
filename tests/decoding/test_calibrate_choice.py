"""decoding/calibrate.py's choice: a trial layout replaces AR only when its measured speed-up
beats the margin, and a trial's speed-up is AR's time over its own."""

from __future__ import annotations

import numpy as np
import pytest

from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule
from prove_jax.decoding import calibrate as cal
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, PROMPTS


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


def test_calibrate_keeps_ar_unless_a_trial_decode_wins_by_the_margin(model, monkeypatch):
    """The real decodes decide: the fastest trial is kept only if it beats AR by `margin`
    (measured 1.04x is noise: AR), and it is the measured best, not the expected best."""
    dec = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(adaptive=True)))
    monkeypatch.setattr(cal, "acceptance_profile", lambda *a: np.array([[0.1, 0.1, 0.1, 0.7]]))
    monkeypatch.setattr(cal, "time_decode_steps",
                        lambda model, b, cands, keep=None, compute=None: {cal.AR: 1.0} | {c: 1.0 for c in cands})
    measured = {}
    monkeypatch.setattr(cal, "trial_speedups", lambda d, p, layouts, b, n: {x: measured[x] for x in layouts})
    cands = [(2, 2), (4, 4)]
    measured.update({(2, 2): 1.03, (4, 4): 1.04})
    assert cal.calibrate(dec, PROMPTS, [1], 8, cands) == ((1, 1, 1),)
    measured.update({(2, 2): 1.3, (4, 4): 1.1})  # (4, 4) is expected to be faster, (2, 2) was
    assert cal.calibrate(dec, PROMPTS, [1], 8, cands) == ((1, 2, 2),)


def test_trial_speedup_is_ar_time_over_layout_time(model, monkeypatch):
    dec = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(adaptive=True)))
    timed = {cal.AR: 2.0, (2, 2): 1.0, (4, 4): 4.0}  # seconds of the fastest decode of each

    def fastest(runs, repeats):
        assert set(runs) == set(timed) and repeats >= 1
        return timed
    monkeypatch.setattr(cal, "fastest_interleaved", fastest)
    assert cal.trial_speedups(dec, PROMPTS, [(2, 2), (4, 4)], 1, 8) == {(2, 2): 2.0, (4, 4): 0.5}
