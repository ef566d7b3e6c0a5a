"""Relaxed lossless (`DecodeOptions.lossless.relaxed_p`): the lossless step's one forward, with a draft also
committed where the proposer's own AR distribution gives it probability >= relaxed_p.

On the shipped arithmetic pair: relaxed_p 1 is exact lossless (== AR token for token); every token
a relaxed run commits is AR's argmax or has AR probability >= relaxed_p after its committed prefix
(checked with the model's cache-free forward over the whole output); a permissive relaxed_p
commits more tokens per forward; bad settings are one-line errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax import assets
from prove_jax.checkpoints.checkpoint import load_model
from prove_jax.cli import generate as generate_cli
from prove_jax.decoding import DecodeError, DecodeOptions, SamplingParams, LosslessRule
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.requests import read_requests
from prove_jax.models.attention import causal_mask

NEW = 40


@pytest.fixture(scope="module")
def arith():
    decoder, tok = build_decoder(assets.ARITH_PROPOSER, DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2)))
    prompts = [tok.encode(r["prompt"]) for r in read_requests(assets.ARITH_TEST)[:6]]
    return decoder, prompts


@pytest.fixture(scope="module")
def relaxed_run(arith):
    """relaxed_p -> the decode of the prompts with it, each decoded once (two tests read 0.3 and 0.05)."""
    decoder, prompts = arith
    runs = {}

    def run(relaxed_p):
        if relaxed_p not in runs:
            d = decoder.with_options(DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2, relaxed_p=relaxed_p)))
            runs[relaxed_p] = d.generate(prompts, NEW, batch_size=len(prompts))
        return runs[relaxed_p]
    return run


@pytest.mark.slow
def test_relaxed_one_is_exact_and_low_p_commits_more(arith, relaxed_run):
    decoder, prompts = arith
    ar = decoder.with_options(DecodeOptions("ar")).generate(prompts, NEW, batch_size=len(prompts))
    runs = {p: relaxed_run(p) for p in (None, 1.0, 0.3, 0.05)}
    assert runs[None].output_ids == ar.output_ids and runs[1.0].output_ids == ar.output_ids
    rate = {p: sum(map(len, r.output_ids)) / int(r.forwards.sum()) for p, r in runs.items()}
    # per step it never commits less; over a run the outputs (and so the steps) differ
    assert rate[0.05] > rate[None], rate


@pytest.mark.parametrize("relaxed_p", [0.3, 0.05])
def test_every_committed_token_is_argmax_or_likely_enough(arith, relaxed_run, relaxed_p):
    _, prompts = arith
    out = relaxed_run(relaxed_p)
    model = load_model(assets.ARITH_PROPOSER)
    # every sequence in one causal forward, padded at the end (padding sees nothing earlier)
    seqs = [list(prompt) + ids for prompt, ids in zip(prompts, out.output_ids)]
    t = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (t - len(s)) for s in seqs], jnp.int32)
    forward = jax.jit(lambda tokens: jax.nn.softmax(model(tokens, jnp.arange(t)[None].repeat(len(seqs), 0),
                                                          causal_mask(len(seqs), t))[0], axis=-1))
    all_probs = np.asarray(forward(batch))
    relaxed_any = False
    for probs, prompt, ids in zip(all_probs, prompts, out.output_ids):
        for i, tok in enumerate(ids):
            row = probs[len(prompt) + i - 1]
            argmax = tok == int(np.argmax(row))
            relaxed_any |= not argmax
            assert argmax or row[tok] >= relaxed_p * (1 - 1e-4), (i, tok, row[tok])
    assert relaxed_any  # the rule was exercised, not only AR's tokens


def test_bad_settings_are_one_line_errors(arith):
    decoder, prompts = arith
    with pytest.raises(DecodeError, match=r"relaxed_p is a probability in \(0, 1\], got 0"):
        DecodeOptions("lossless", 4, lossless=LosslessRule(relaxed_p=0.0)).validate()
    with pytest.raises(DecodeError, match="mode 'threshold' has none"):
        DecodeOptions("threshold", 4, lossless=LosslessRule(relaxed_p=0.3)).validate()
    relaxed = decoder.with_options(DecodeOptions("lossless", 4, lossless=LosslessRule(relaxed_p=0.3)))
    with pytest.raises(DecodeError, match="for greedy decoding"):
        relaxed.generate(prompts[:1], 4, params=SamplingParams(temperature=0.7, seed=1))
    args = generate_cli.parse_args(["--prompt", "x", "--mode", "ar", "--relaxed-p", "0.3"])
    with pytest.raises(DecodeError, match="--relaxed-p applies with --mode lossless"):
        generate_cli.check_mode_options(args)
    args = generate_cli.parse_args(["--prompt", "x", "--relaxed-p", "2"])
    with pytest.raises(DecodeError, match=r"^--relaxed-p is a probability"):
        generate_cli.decode_options(args)
