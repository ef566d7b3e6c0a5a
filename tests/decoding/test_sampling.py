"""Sampling: the processed distribution against transformers' warpers, AR and ProVe-lossless
sampling against the exact distribution enumerated from transformers' logits, seeds, and
temperature 0 as greedy.

The distribution tests draw many completions of one prompt (one request per seed) from a model
with an 8-token vocabulary, so every sequence of 5 new tokens can be enumerated: transformers'
logits at every prefix, processed by its own warpers, give the exact probability of each
sequence. A chi-square test compares the counts with it; a deliberately wrong acceptance rule
must fail the same test.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from prove_jax.checkpoints.checkpoint import load_model
from prove_jax.checkpoints.convert import hf_to_flax
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, sampling, LosslessRule
from prove_jax.decoding.sampling import RowSampling, Sampler, SamplingParams
from tests.hf_models import make_hf_qwen2
from tests.decode_helpers import random_prompts


def _hf_warpers(p: SamplingParams) -> LogitsProcessorList:
    """transformers' warpers for `p`, in the order `generate` builds them."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    return warpers


def _hf_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64 [..., V] probabilities transformers samples from, for float32 logits [..., V]."""
    flat = torch.tensor(logits.reshape(-1, logits.shape[-1]), dtype=torch.float32)
    warped = _hf_warpers(p)(None, flat)
    return torch.softmax(warped.double(), -1).numpy().reshape(logits.shape)


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
          SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0, top_p=0.8),
          SamplingParams(temperature=0.8, top_k=7, top_p=0.6), SamplingParams(temperature=1.0, min_p=0.2),
          SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05), SamplingParams(temperature=2.0, top_k=1)]


def test_processed_distribution_equals_transformers_warpers():
    """Every row of one batch has its own parameters (traced), as in a decode program."""
    rs = np.random.RandomState(0)
    logits = (rs.randn(len(PARAMS), 3, 50) * 3).astype(np.float32)
    rows = RowSampling.from_params(PARAMS, [0] * len(PARAMS))
    ours = jax.jit(sampling.token_probs, static_argnums=2)(jnp.asarray(logits), rows, Sampler(True, True))
    for i, p in enumerate(PARAMS):
        want = _hf_probs(logits[i], p)
        np.testing.assert_allclose(np.asarray(ours[i]), want, atol=1e-6, err_msg=str(p))
        assert ((np.asarray(ours[i]) > 0) == (want > 0)).all(), p  # the same tokens survive
    # a filter no row uses may be compiled out: rows with temperature alone are unchanged
    plain = sampling.token_probs(jnp.asarray(logits[:2]), RowSampling.from_params(PARAMS[:2], [0, 0]), Sampler())
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ours[:2]), atol=1e-7)


def test_temperature_zero_rows_are_one_hot_at_the_greedy_token():
    logits = jnp.asarray([[[0.5, 2.0, 2.0, -1.0]]], jnp.float32)
    probs = sampling.token_probs(logits, RowSampling.from_params([SamplingParams()], [0]), Sampler(True, True))
    np.testing.assert_array_equal(np.asarray(probs), [[[0.0, 1.0, 0.0, 0.0]]])  # first of a tie


# ---- the exact distribution of a short completion -----------------------------------------

VOCAB, MASK, NEW = 8, 7, 5
PROMPT = [2, 3, 4]
DRAWS = 4000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our converted model) with an 8-token vocabulary."""
    d = tmp_path_factory.mktemp("tiny8")
    hf = make_hf_qwen2(d / "hf", seed=7, vocab_size=VOCAB, mask_token_id=MASK, initializer_range=0.35,
                       bias_std=0.3)
    hf_to_flax(str(d / "hf"), str(d / "ours"))
    return hf, load_model(str(d / "ours"))


def _exact_distribution(hf, p: SamplingParams) -> np.ndarray:
    """float64 [V] * NEW: the probability of every completion of PROMPT, from transformers'
    logits at every prefix (one forward of all V^(NEW-1) prefixes) and its warpers."""
    prefixes = np.asarray(list(itertools.product(range(VOCAB), repeat=NEW - 1)), np.int64)
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    with torch.no_grad():
        logits = hf(torch.tensor(tokens)).logits[:, len(PROMPT) - 1:].float().numpy()  # [P, NEW, V]
    cond = _hf_probs(logits, p)  # cond[s, t] = P(x_{t+1} | PROMPT, prefix s up to t)
    joint = np.ones([VOCAB] * NEW)
    for t in range(NEW):
        # sequences x_1..x_NEW: the conditional of x_{t+1} given x_1..x_t from any prefix starting so
        table = cond[:, t].reshape([VOCAB] * (NEW - 1) + [VOCAB])
        table = table[(slice(None),) * t + (0,) * (NEW - 1 - t)]  # [V]*t + [V]: later prefix tokens unused
        joint = joint * table.reshape([VOCAB] * (t + 1) + [1] * (NEW - 1 - t))
    np.testing.assert_allclose(joint.sum(), 1.0, atol=1e-9)
    return joint


def _chi_square_p(counts: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value of `counts` against `expected_probs` (flattened), cells with
    fewer than `min_expected` expected draws pooled into one."""
    counts, probs = counts.ravel().astype(np.float64), expected_probs.ravel()
    n = counts.sum()
    big = probs * n >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a draw the exact distribution gives probability 0"
    return float(scipy.stats.chisquare(obs[keep], exp[keep]).pvalue)


def _sample(model, options: DecodeOptions, p: SamplingParams):
    """DRAWS completions of PROMPT, one request (seed) each, in one batch."""
    res = Decoder(model, [], options).generate([PROMPT] * DRAWS, NEW, batch_size=DRAWS, params=p, seed=11)
    outs = np.asarray(res.output_ids)
    assert outs.shape == (DRAWS, NEW)
    return outs, res


def _test_against_exact(outs: np.ndarray, joint: np.ndarray) -> tuple[float, float]:
    """p-values of the first three tokens' joint and of the last two tokens' joint."""
    head = np.zeros([VOCAB] * 3)
    np.add.at(head, tuple(outs[:, :3].T), 1)
    tail = np.zeros([VOCAB] * 2)
    np.add.at(tail, tuple(outs[:, 3:].T), 1)
    return (_chi_square_p(head, joint.sum(axis=(3, 4))),
            _chi_square_p(tail, joint.sum(axis=(0, 1, 2))))


ALPHA = 1e-3  # the draws are seeded: a correct sampler passes at this level, and does so every run
SETTINGS = [("ar", 1, None, SamplingParams(temperature=1.0)),
            ("ar", 1, None, SamplingParams(temperature=0.9, top_k=5, top_p=0.9)),
            ("lossless", 2, None, SamplingParams(temperature=1.0)),
            ("lossless", 4, 2, SamplingParams(temperature=1.0)),
            ("lossless", 4, None, SamplingParams(temperature=0.9, top_k=5, top_p=0.9)),
            ("lossless", 3, 2, SamplingParams(temperature=1.2, min_p=0.1))]


@pytest.mark.parametrize("mode,k,groups,params", SETTINGS, ids=[f"{m}-K{k}-G{g}-{i}" for i, (m, k, g, _) in enumerate(SETTINGS)])
def test_sampling_draws_from_the_exact_ar_distribution(tiny, mode, k, groups, params):
    hf, ours = tiny
    joint = _exact_distribution(hf, params)
    outs, res = _sample(ours, DecodeOptions(mode, k, lossless=LosslessRule(max_groups=groups)), params)
    if mode == "lossless":  # the rule decided both ways: drafts were accepted and rejected
        later = res.accept_hist.sum(axis=0)
        assert later[1:].sum() > DRAWS // 10 and res.forwards.sum() > DRAWS * 2
    p_head, p_tail = _test_against_exact(outs, joint)
    assert min(p_head, p_tail) > ALPHA, (p_head, p_tail)


def test_a_wrong_acceptance_rule_fails_the_same_test(tiny, monkeypatch):
    """Accepting a draft whenever q >= p (instead of with probability min(1, p/q)) skews the
    distribution, and the test above sees it."""
    hf, ours = tiny
    params = SamplingParams(temperature=1.0)
    real = sampling.speculative_accept

    def wrong(p, q, drafts, u, valid):  # u = 0 accepts (when p > 0), u = inf rejects
        q_draft, p_draft = (jnp.take_along_axis(x, drafts[..., None], -1)[..., 0] for x in (q, p[:, :-1]))
        return real(p, q, drafts, jnp.where(q_draft >= p_draft, 0.0, jnp.inf), valid)
    monkeypatch.setattr(sampling, "speculative_accept", wrong)
    outs, _ = _sample(ours, DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)), params)
    assert min(_test_against_exact(outs, _exact_distribution(hf, params))) < 1e-6


# ---- seeds, temperature 0 --------------------------------------------------------------------

@pytest.mark.parametrize("mode,k", [("ar", 1), ("lossless", 4), ("threshold", 4)])
def test_a_seed_gives_the_same_output_in_any_batch_row_and_order(model, mode, k):
    prompts = random_prompts(5, (3, 9, 1, 14, 6, 2, 11, 4, 7, 5, 12, 8, 3, 10, 2, 6))
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    dec = Decoder(model, [1], DecodeOptions(mode, k))
    alone = [dec.generate([p], 16, params=[q]).output_ids[0] for p, q in zip(prompts[:4], params[:4])]
    for batch in (4, 16):
        got = dec.generate(prompts, 16, batch_size=batch, params=params).output_ids
        assert got[:4] == alone
    order = np.random.RandomState(0).permutation(len(prompts))
    shuffled = dec.generate([prompts[i] for i in order], 16, batch_size=4, params=[params[i] for i in order])
    assert [shuffled.output_ids[list(order).index(i)] for i in range(4)] == alone
    other_seeds = dec.generate(prompts[:4], 16, params=[dataclasses.replace(q, seed=q.seed + 50) for q in params[:4]])
    assert other_seeds.output_ids != alone  # the seed, not the prompt alone, decides


@pytest.mark.parametrize("mode,k", [("ar", 1), ("threshold", 4), ("lossless", 4), ("verify", 4)])
def test_temperature_zero_is_greedy_in_every_mode(model, mode, k):
    """Explicit temperature 0 runs today's greedy program; in a call that also samples, its
    rows still get exactly the greedy tokens."""
    prompts = random_prompts(2)
    dec = Decoder(model, [1], DecodeOptions(mode, k), verifier=model if mode == "verify" else None)
    greedy = dec.generate(prompts, 20, batch_size=2)
    zero = dec.generate(prompts, 20, batch_size=2, params=SamplingParams(temperature=0.0, top_k=3))
    assert zero.output_ids == greedy.output_ids
    np.testing.assert_array_equal(zero.forwards, greedy.forwards)
    mixed = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams() for i in range(len(prompts))]
    got = dec.generate(prompts, 20, batch_size=2, params=mixed)
    assert [o for i, o in enumerate(got.output_ids) if i % 2 == 0] == greedy.output_ids[::2]
    assert [o for i, o in enumerate(got.output_ids) if i % 2] != greedy.output_ids[1::2]


# ---- per-request controls ---------------------------------------------------------------------

def test_per_request_budgets_stop_tokens_and_finish_reasons(model):
    prompts = random_prompts(3, (4, 7, 2))
    dec = Decoder(model, [1], DecodeOptions("lossless", 4))
    free = dec.generate(prompts, 24).output_ids
    stop_at = free[1][5]  # a token request 1 generates: it must end there
    params = [SamplingParams(max_new_tokens=3), SamplingParams(stop_token_ids=(stop_at,)), SamplingParams()]
    res = dec.generate(prompts, 24, params=params)
    assert res.output_ids[0] == free[0][:3] and res.finish_reasons[0] == "length"
    assert res.output_ids[1] == free[1][: free[1].index(stop_at) + 1] and res.finish_reasons[1] == "stop"
    assert res.output_ids[2] == free[2]
    assert res.finish_reasons[2] == ("stop" if free[2][-1] == 1 else "length")


def test_bad_sampling_params_are_named():
    for bad, words in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                       (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(seed=2 ** 32), "seed"),
                       (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop"),
                       (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(DecodeError, match=words):
            SamplingParams(**bad).validate()
    assert SamplingParams(stop="x").validate().stop == ("x",)
