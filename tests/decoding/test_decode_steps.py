"""The decode steps against naive decoders built from plain full causal forwards of the same
model (no KV cache, no step layouts, no loop state) that follow docs/method.md section 3 step by
step: threshold and verify blocks, the verifier's likelihood rule, EOS handling, and every step
of lossless decoding (commits, acceptance, shifted drafts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax import assets
from prove_jax.evaluation import humaneval
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer
from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule, ThresholdRule, VerifyRule
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.models.attention import causal_mask
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, NEW, NO_EOS, PROMPTS, tau_in_widest_middle_gap


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


@pytest.fixture(scope="module")
def verifier():
    """A separate random verifier with sharp distributions (a fresh one is nearly uniform)."""
    v = create_model(CFG.replace(num_layers=1), seed=5)
    v.final_norm.weight[...] = v.final_norm.weight[...] * 20
    return v


@pytest.fixture(scope="module")
def ar(model):
    """Greedy AR of PROMPTS without EOS."""
    return Decoder(model, NO_EOS, DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids


def _forward(model, length: int, argmax: bool = False):
    """rows of tokens (each <= length) -> log-probabilities [B, length, V] (or their argmax
    [B, length]) of one full causal forward without a cache; rows are right-padded, which a
    causal forward cannot see."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, toks):
        b = toks.shape[0]
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        logits, _ = nnx.merge(graphdef, state)(toks, pos, causal_mask(b, length))
        return jnp.argmax(logits, axis=-1) if argmax else jax.nn.log_softmax(logits, axis=-1)

    def fwd(rows):
        toks = np.zeros((len(rows), length), np.int32)
        for r, row in enumerate(rows):
            toks[r, : len(row)] = row
        return np.asarray(run(state, jnp.asarray(toks)))
    return fwd


def _cut(out, eos):
    """`out` up to and including its first token in `eos`."""
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


K = 4


def _naive_block(logp, ctx_len: int, k: int = K) -> list[int]:
    """A MARS block from a forward over [committed, MASK x (K-1)]: the argmax at the last
    committed token (exact AR) and at the masks."""
    return logp[ctx_len - 1: ctx_len - 1 + k].argmax(-1).tolist()


@pytest.fixture(scope="module")
def blocks(model):
    """Naive threshold decoding with tau 0: every step commits its whole block."""
    fwd = _forward(model, 64)
    outs = [[] for _ in PROMPTS]
    while any(len(o) < NEW for o in outs):
        logp = fwd([p + o + [CFG.mask_token_id] * (K - 1) for p, o in zip(PROMPTS, outs)])
        for r, (p, o) in enumerate(zip(PROMPTS, outs)):
            o += _naive_block(logp[r], len(p) + len(o))[: NEW - len(o)]
    return outs


def test_whole_blocks_equal_naive_blocks(model, verifier, blocks, ar):
    """tau 0 (threshold) and tau_v 0 (verify, likelihood rule) commit all K tokens of every
    block; each block is what a full forward over [committed, masks] proposes, so the pending
    tokens of one step (K at once, their KV written by the next) are read and cached right."""
    assert blocks != ar  # the masks' guesses are not AR: a wrong context would show
    thr = Decoder(model, NO_EOS, DecodeOptions("threshold", K, threshold=ThresholdRule(tau=0.0))).generate(PROMPTS, NEW)
    assert thr.output_ids == blocks and (thr.forwards == NEW // K).all()
    prob0 = Decoder(model, NO_EOS, DecodeOptions("verify", K, verify=VerifyRule(commit_rule="prob", tau_v=0.0)),
                    verifier=verifier).generate(PROMPTS, NEW)
    assert prob0.output_ids == blocks
    assert (prob0.forwards == NEW // K).all() and (prob0.verifier_forwards == NEW // K).all()


def test_verify_likelihood_rule_commits_as_the_verifier_probabilities_say(model, verifier):
    """Every step of verify/prob against a naive loop: the block from a full proposer forward,
    the verifier's p(D_{i+1}) from a full verifier forward over [committed, D], and the commit
    1 + the prefix with p >= tau_v. tau_v sits in a wide gap of the first step's values, and
    no value met on the way lies within float noise of it."""
    pfwd, vfwd = _forward(model, 64), _forward(verifier, 64)

    def step(ctxs):
        logp = pfwd([c + [CFG.mask_token_id] * (K - 1) for c in ctxs])
        blks = [_naive_block(logp[i], len(c)) for i, c in enumerate(ctxs)]
        vlogp = vfwd([c + b for c, b in zip(ctxs, blks)])
        probs = [np.exp([vlogp[i, len(c) + j, b[j + 1]] for j in range(K - 1)]) for i, (c, b) in
                 enumerate(zip(ctxs, blks))]
        return blks, probs

    tau = tau_in_widest_middle_gap(np.concatenate(step(PROMPTS)[1]))
    outs, commits, seen = [[] for _ in PROMPTS], [[] for _ in PROMPTS], []
    while any(len(o) < NEW for o in outs):
        live = [r for r, o in enumerate(outs) if len(o) < NEW]
        blks, probs = step([PROMPTS[r] + outs[r] for r in live])
        for r, b, p in zip(live, blks, probs):
            seen.extend(p)
            n = min(1 + int(np.cumprod(p >= tau).sum()), NEW - len(outs[r]))
            outs[r] += b[:n]
            commits[r].append(n)
    assert np.abs(np.log(seen) - np.log(tau)).min() > 1e-4  # far beyond float noise
    assert len({n for c in commits for n in c[:-1]}) >= 2  # the rule decides something here
    res = Decoder(model, NO_EOS, DecodeOptions("verify", K, verify=VerifyRule(commit_rule="prob", tau_v=tau), record_steps=True),
                  verifier=verifier).generate(PROMPTS, NEW)
    assert res.step_commits == commits
    assert res.output_ids == outs
    assert list(res.verifier_forwards) == list(res.forwards) == [len(c) for c in commits]


def test_eos_only_cuts_the_output_and_a_finished_row_stops_counting(model, verifier, ar, blocks):
    """With EOS ids the output is the EOS-free output cut after its first EOS. One EOS is a
    mask's guess inside a row's first block, past the one token a step commits there (it must
    not end the row), the other ends some AR rows early: their forwards (and the verifier's)
    stop when they finish while the other rows go on."""
    for r, e in ((r, b[1]) for r, b in enumerate(blocks)):
        if e in ar[r][:2]:
            continue
        others = [t for out in ar for t in out[2:-2] if t not in (e, ar[r][0]) and any(t not in o for o in ar)]
        if others:
            eos = [e, others[0]]
            break
    else:
        raise AssertionError("no EOS pair fits these prompts")
    want = [_cut(out, eos) for out in ar]
    assert min(map(len, want)) < NEW and max(map(len, want)) == NEW
    for opts, v in ((DecodeOptions("threshold", K, threshold=ThresholdRule(tau=1.01)), None),
                    (DecodeOptions("verify", K, verify=VerifyRule(commit_rule="prob", tau_v=1.5)), verifier)):
        res = Decoder(model, eos, opts, verifier=v).generate(PROMPTS, NEW)
        assert res.output_ids == want, opts.mode
        assert list(res.forwards) == [len(o) for o in want]  # one exact token per forward
        assert (res.accept_hist.sum(1) == res.forwards).all()
        assert list(res.verifier_forwards) == (list(res.forwards) if v is not None else [0] * len(want))


def _naive_lossless(greedy_fn, prompts, k: int, groups: int | None, max_new: int, mask_id: int, pad_id: int = 0):
    """docs/method.md 3c with full forwards: per step, verify the drafts (greedy over [committed,
    drafts]), accept their AR-matching prefix a and commit a + 1 tokens; the next drafts come
    from the group serving j = the largest served length <= a (a forward over [committed up to
    d_j, MASK x M]), shifted by a - j, the vacated tail repeating the last guess; a group serves
    at most the row's real drafts. Returns, per row, the tokens each step commits, the drafts
    each step accepts and the output; and how many steps shifted their drafts."""
    layout = LosslessLayout.build(k, groups)
    m = k - 1
    n = len(prompts)
    ctx = [list(p) for p in prompts]
    drafts = [[pad_id] * m for _ in prompts]
    real = [0] * n
    commits, accepted = [[] for _ in prompts], [[] for _ in prompts]
    shifted = 0
    while True:
        live = [r for r in range(n) if len(ctx[r]) - len(prompts[r]) < max_new]
        if not live:
            break
        greedy = greedy_fn([ctx[r] + drafts[r] for r in range(n)])
        group_rows = []
        for r in live:
            p0 = len(ctx[r]) - 1
            g = greedy[r, p0: p0 + m + 1].tolist()
            a = 0
            while a < m and drafts[r][a] == g[a]:
                a += 1
            j = max(s for s in (min(x, real[r]) for x in layout.accept_of_group) if s <= a)
            group_rows.append((r, ctx[r] + drafts[r][:j], a - j))
            c = min(a + 1, max_new - (len(ctx[r]) - len(prompts[r])))
            ctx[r] += g[:c]
            commits[r].append(c)
            accepted[r].append(a)
        seqs = [list(prompts[r]) for r in range(n)]
        for r, seq, _ in group_rows:
            seqs[r] = seq + [mask_id] * m
        guesses = greedy_fn(seqs)
        for r, seq, shift in group_rows:
            pred = guesses[r, len(seq): len(seq) + m].tolist()  # mask i guesses the token after it
            drafts[r] = [pred[min(shift + i, m - 1)] for i in range(m)]
            real[r] = m - shift
            shifted += shift > 0
    return commits, accepted, [c[len(p):] for c, p in zip(ctx, prompts)], shifted


@pytest.fixture(scope="module")
def demo():
    """The shipped proposer (float32) on HumanEval prompts cut in the middle of their docstring,
    where it accepts all, none and part of its blocks (whole prompts it mostly accepts in full):
    partial acceptance is what exercises shifted drafts."""
    proposer = load_model(assets.DEMO_PROPOSER, dtype="float32", param_dtype="float32")
    tok = load_tokenizer(assets.DEMO_PROPOSER)
    ids = [tok.encode(p["prompt"]) for p in humaneval.load_problems(limit=4)]
    prompts = [x[: len(x) // 2][-48:] for x in ids]
    return proposer, prompts, _forward(proposer, 112, argmax=True)


def test_lossless_steps_follow_a_naive_prove_lossless(demo):
    """Not only the output (equal to AR whatever the drafts) but every step's commit and
    acceptance: wrong drafts, group positions or masks, a wrong shift or real-draft count only
    cost acceptance, which only this comparison sees. K=6 with 3 groups serves a = 0, 1 and 5,
    so accepting 2-4 drafts shifts the next ones."""
    k, groups = 6, 3
    proposer, prompts, greedy_fn = demo
    max_new = 40
    commits, accepted, outs, shifted = _naive_lossless(greedy_fn, prompts, k, groups, max_new,
                                                        proposer.cfg.mask_token_id)
    assert shifted >= 5  # partial acceptances beyond the served lengths happened
    res = Decoder(proposer, NO_EOS, DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=groups), record_steps=True)
                  ).generate(prompts, max_new)
    assert res.output_ids == outs
    assert res.step_commits == commits
    assert res.accept_hist.tolist() == [np.bincount(a, minlength=k + 1).tolist() for a in accepted]
