"""decoding/request_run.py: a request job run in chunks: one compiled program for every chunk,
outputs equal to greedy AR, and per-request and summary stats that add up to the outputs."""

from __future__ import annotations

import numpy as np
import pytest

from prove_jax.decoding import BatchResult, DecodeOptions, Decoder, LosslessRule
from prove_jax.decoding import request_run
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, NEW, NO_EOS, PROMPTS


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


@pytest.fixture(scope="module")
def ar(model):
    """Greedy AR of PROMPTS without EOS."""
    return Decoder(model, NO_EOS, DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids


def test_run_requests_stats_add_up_and_every_chunk_shares_one_program(model, ar, monkeypatch):
    """Chunks of 2 requests whose own prompt widths differ (32, 16, 32 after rounding) still run
    one compiled program; per-request and summary stats are those of the outputs."""
    monkeypatch.setattr(request_run, "QUEUE_BATCHES", 1)
    dec = Decoder(model, NO_EOS, DecodeOptions("lossless", 3, lossless=LosslessRule(max_groups=2)))
    results, summary = request_run.run_requests(dec, PROMPTS, NEW, 2, progress=False)
    outputs, stats = [r.output_ids for r in results], [r.stats for r in results]
    assert dec.trace_count == 1
    assert outputs == ar
    for out, st in zip(outputs, stats):
        assert st["generated_tokens"] == len(out) == NEW
        assert sum(st["accept_hist"]) == st["proposer_forwards"] >= 1
        assert st["tokens_per_forward"] == pytest.approx(len(out) / st["proposer_forwards"])
        assert st["verifier_forwards"] == 0  # lossless has no verifier
    fwd = sum(st["proposer_forwards"] for st in stats)
    assert summary["requests"] == len(PROMPTS) and summary["generated_tokens"] == NEW * len(PROMPTS)
    assert summary["proposer_forwards"] == fwd and summary["verifier_forwards"] == 0
    assert summary["tokens_per_forward"] == pytest.approx(NEW * len(PROMPTS) / fwd)
    assert summary["setting"] == "lossless K=3,G=2"


class _ScriptedDecoder:
    """A stand-in decoder whose per-request counts are set by hand: request i (a prompt [i])
    gets i + 1 tokens in i + 1 proposer forwards and 2 x (i + 1) verifier forwards; each call
    takes 1.5 s to decode and 4 s to compile."""

    def __init__(self):
        self.options = DecodeOptions("verify", 4).validate()
        self.calls = []

    def check_prompts(self, prompts, max_new_tokens, names=None):
        pass

    def generate(self, prompts, max_new_tokens, batch_size=None, prompt_width=None, queue_size=None,
                 params=None):
        self.calls.append((len(prompts), batch_size, prompt_width, queue_size))
        n = [p[0] + 1 for p in prompts]
        return BatchResult(output_ids=[[7] * k for k in n], forwards=np.array(n),
                           verifier_forwards=2 * np.array(n), accept_hist=np.zeros((len(n), 5), int),
                           seconds=1.5, compile_seconds=4.0, options=self.options,
                           step_commits=None, loop_steps=0, finish_reasons=["length"] * len(n))


def test_run_requests_summary_counts_verifier_forwards_and_decode_time_only(monkeypatch):
    monkeypatch.setattr(request_run, "QUEUE_BATCHES", 2)
    dec = _ScriptedDecoder()
    prompts = [[i] * (1 + i % 3) for i in range(5)]  # lengths 1, 2, 3, 1, 2
    results, summary = request_run.run_requests(dec, prompts, 8, 2, progress=False)
    outputs, stats = [r.output_ids for r in results], [r.stats for r in results]
    # chunks of 2 x 2 requests, every one at the run's prompt width and queue size
    assert dec.calls == [(4, 2, 3, 4), (1, 2, 3, 4)]
    assert [len(o) for o in outputs] == [1, 2, 3, 4, 5]
    assert [s["verifier_forwards"] for s in stats] == [2, 4, 6, 8, 10]
    assert summary["generated_tokens"] == 15 and summary["proposer_forwards"] == 15
    assert summary["verifier_forwards"] == 30
    assert summary["decode_seconds"] == 3.0 and summary["compile_seconds"] == 8.0
    assert summary["tokens_per_second"] == pytest.approx(15 / 3.0)  # compile time not in it
    assert summary["setting"] == "verify K=4,top1"
