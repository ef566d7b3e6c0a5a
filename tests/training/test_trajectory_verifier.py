"""The shipped arith verifier was trained on the arith proposer's own greedy solutions.

Its top-1 prediction, teacher-forced on the proposer's greedy continuation of a test problem,
must match the proposer's token far more often than the untrained demo verifier does, and
more often than the verifier trained only on reference solutions did (0.79 of these tokens;
0.89 after the trajectory stage; benchmarks/trajectory_verifier.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax import assets
from prove_jax.checkpoints.checkpoint import load_model
from prove_jax.decoding import DecodeOptions
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.requests import read_requests

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def greedy():
    records = read_requests(assets.ARITH_TEST)[:8]
    ar, tok = build_decoder(assets.ARITH_PROPOSER, DecodeOptions("ar"))
    prompts = [tok.encode(r["prompt"]) for r in records]
    return prompts, [list(o) for o in ar.generate(prompts, NEW_TOKENS).output_ids]


def top1_agreement(path, prompts, continuations):
    """Fraction of continuation tokens that are the model's argmax given everything before."""
    model = load_model(path, dtype="float32", param_dtype="float32")
    seqs = [p + c for p, c in zip(prompts, continuations)]
    width = max(map(len, seqs))
    # right padding: under the causal mask no real position sees a pad
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (len(seqs), width, width))
    positions = jnp.broadcast_to(jnp.arange(width), (len(seqs), width))
    pred = np.asarray(jnp.argmax(model(batch, positions, mask)[0], -1))
    hits = total = 0
    for row, (p, c) in enumerate(zip(prompts, continuations)):
        hits += int((pred[row, len(p) - 1:len(p) + len(c) - 1] == np.asarray(c)).sum())
        total += len(c)
    return hits / total


def test_trajectory_verifier_predicts_the_proposers_greedy_tokens(greedy):
    prompts, continuations = greedy
    assert all(len(c) > 10 for c in continuations)
    # the measurement itself: the proposer reproduces its own greedy tokens
    assert top1_agreement(assets.ARITH_PROPOSER, prompts, continuations) == 1.0
    traj = top1_agreement(assets.ARITH_VERIFIER, prompts, continuations)
    untrained = top1_agreement(assets.DEMO_VERIFIER, prompts, continuations)
    assert traj > untrained + 0.3, (traj, untrained)
    # above what the reference-trained verifier reached on these tokens (0.79)
    assert traj > 0.85, traj
