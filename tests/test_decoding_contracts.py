"""Decoding contracts the rest of the suite let through: each test was written against a
plausible bug (a mutant of the code) that every other test passed, and fails on it.

Oracles: naive decoders built from plain full causal forwards of the same model (no KV cache,
no step layouts, no loop state) that follow docs/method.md section 3 step by step; identities
between a run's outputs and its stats; "an EOS only cuts the output"; and the documented
errors, labels and defaults.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax import assets
from prove_jax.evaluation import humaneval
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, adapt_for_batch
from prove_jax.decoding import calibrate as cal
from prove_jax.decoding import request_run
from prove_jax.decoding import results_file
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.models.attention import causal_mask
from prove_jax.models.params import create_model
from tests.test_decoding import CFG, _prompts, _tau_in_widest_middle_gap

PROMPTS = _prompts(6, (20, 3, 9, 2, 17))
NEW = 24
NO_EOS = [-1]


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


# ---- option and request errors at their bounds (no compile) -------------------------------

def test_request_and_option_errors_at_their_bounds(model):
    dec = Decoder(model, [1], DecodeOptions("ar"), max_buffer=64)
    dec.check_prompts([[2] * 54], 10)  # 54 + 10 = 64 positions: exactly the buffer, allowed
    with pytest.raises(DecodeError, match="needs 65 positions, longer than the buffer limit 64"):
        dec.check_prompts([[2] * 55], 10)
    dec.check_prompts([[0, CFG.vocab_size - 1]], 4)  # the first and the last id are tokens
    for bad in (CFG.vocab_size, -1):
        with pytest.raises(DecodeError, match=rf"prompt 1 has token id {bad} outside the vocabulary "
                                              rf"\[0, {CFG.vocab_size}\)"):
            dec.check_prompts([[2, 3], [2, bad]], 4)
    with pytest.raises(DecodeError, match="max_new_tokens must be >= 1, got 0"):
        dec.generate([[2, 3]], 0)
    with pytest.raises(DecodeError, match="lossless mode needs --block-size >= 2"):
        DecodeOptions("lossless", 1).validate()
    with pytest.raises(DecodeError, match="unknown confidence 'logit'"):
        DecodeOptions("threshold", 4, confidence="logit").validate()
    with pytest.raises(DecodeError, match="unknown commit rule 'oracle'"):
        DecodeOptions("verify", 4, commit_rule="oracle").validate()
    with pytest.raises(DecodeError, match="max groups must be >= 1, got 0"):
        DecodeOptions("lossless", 4, max_groups=0).validate()
    # a step may be exactly as wide as the buffer (lossless K=40, one group: 1 + 39 x 2 = 79)
    Decoder(model, [1], DecodeOptions("lossless", 40, max_groups=1), max_buffer=79)
    with pytest.raises(DecodeError, match="feeds 79 tokens per step"):
        Decoder(model, [1], DecodeOptions("lossless", 40, max_groups=1), max_buffer=78)
    # with_options checks the model pairing as the constructor does
    with pytest.raises(DecodeError, match="needs a verifier model"):
        dec.with_options(DecodeOptions("verify", 4))
    with pytest.raises(DecodeError, match=re.escape("needs a MARS proposer with a <|mask|> token")):
        Decoder(create_model(CFG.replace(mask_token_id=None)), [1]).with_options(DecodeOptions("threshold", 4))
    assert dec.trace_count == 0


def test_describe_options_names_what_ran():
    from prove_jax.decoding.request_run import describe_options
    d = lambda o: describe_options(o.validate())  # noqa: E731
    assert d(DecodeOptions("ar", 8)) == "ar"
    assert d(DecodeOptions("lossless", 6, max_groups=2)) == "lossless K=6,G=2"
    assert d(DecodeOptions("lossless", 4)) == "lossless K=4,G=4"
    assert d(DecodeOptions("verify", 8, commit_rule="head")) == "verify K=8,head"
    assert d(DecodeOptions("threshold", 8, tau=0.8)) == "threshold K=8,prob>=0.8"
    assert d(DecodeOptions("threshold", 8, confidence="margin")) == "threshold K=8,margin>=0.8"
    # entropy passes at most tau nats
    assert d(DecodeOptions("threshold", 8, confidence="entropy")) == "threshold K=8,entropy<=0.5"


def test_adaptive_layout_respects_the_block_size_and_group_caps():
    """The table proposes (K, groups) per batch size; --block-size and --groups cap both, and a
    row with K = 1 means AR for its batch sizes (later rows do not apply to them)."""
    opts = DecodeOptions("lossless", 4, max_groups=2, adaptive=True)
    table = ((1, 8, 8), (4, 3, 3), (8, 1, 1), (16, 6, 2))

    def setting(b, **kw):
        o = adapt_for_batch(opts, b, table=table, **kw)
        return (o.mode, o.block_size, o.max_groups if o.mode == "lossless" else None)
    assert [setting(b) for b in (1, 2, 4, 8, 16, 32)] == [
        ("lossless", 4, 2), ("lossless", 3, 2), ("lossless", 3, 2), ("ar", 1, None), ("lossless", 4, 2),
        ("ar", 1, None)]
    gpu = adapt_for_batch(opts, 1, platform="gpu")  # the platform table's (1, 8, 8), capped
    assert (gpu.block_size, gpu.max_groups) == (4, 2)
    uncapped = adapt_for_batch(DecodeOptions("lossless", 8, adaptive=True), 1, table=table)
    assert (uncapped.block_size, uncapped.max_groups) == (8, 8)


def test_cli_block_size_defaults_and_calibrate_decodes_adaptively(tmp_path, monkeypatch, capsys):
    """Documented defaults: K = 8, lossless 4, but --calibrate searches up to 8; --calibrate
    (like --adaptive) makes the decoder follow its per-batch table, or the table it installs
    would be ignored."""
    from prove_jax.cli import generate
    seen = []

    def build(path, options, **kw):
        seen.append(options)
        raise DecodeError("stop before loading")
    monkeypatch.setattr(generate, "build_decoder", build)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4]}) + "\n")
    base = ["--input", str(inp), "--output", str(tmp_path / "out.jsonl")]
    for extra, want in [([], ("lossless", 4, False)), (["--mode", "ar"], ("ar", 1, False)),
                        (["--mode", "threshold"], ("threshold", 8, False)),
                        (["--mode", "verify"], ("verify", 8, False)),
                        (["--mode", "lossless"], ("lossless", 4, False)),
                        # adaptive: the widest table layout (K=8) unless --block-size caps it
                        (["--mode", "lossless", "--adaptive"], ("lossless", 8, True)),
                        (["--mode", "lossless", "--adaptive", "--block-size", "4"], ("lossless", 4, True)),
                        (["--mode", "lossless", "--calibrate"], ("lossless", 8, True)),
                        (["--mode", "lossless", "--calibrate", "--block-size", "3"], ("lossless", 3, True))]:
        assert generate.main(base + extra) == 2
        assert "stop before loading" in capsys.readouterr().err
        assert (seen[-1].mode, seen[-1].block_size, seen[-1].adaptive) == want, extra


# ---- output files ---------------------------------------------------------------------------

def test_the_results_file_keeps_whole_records_and_lets_a_rerun_skip_them(tmp_path):
    """A killed job leaves whole lines and maybe one torn one: the rerun cuts the torn line off,
    drops failed requests' records (they are tried again) and skips the rest; --sort rewrites
    the file in input order; a line that is not a record, before the end, is refused."""
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "b", "output_ids": [1]}) + "\n" + json.dumps({"id": 7, "error": "x"})
                   + "\n" + json.dumps({"id": "a", "output_ids": [2]}) + "\n" + '{"id": "c", "outp')
    results = results_file.ResultsFile(str(out))
    assert set(results.done()) == {"a", "b"}
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["b", "a"]
    results.write({"id": "c", "output_ids": [3]})
    results.close()
    results.sort(["a", 7, "b", "c"])
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]
    out.write_text("not json\n" + json.dumps({"id": "a"}) + "\n")
    with pytest.raises(DecodeError, match="not an output record"):
        results_file.ResultsFile(str(out)).done()


def test_run_requests_stats_add_up_and_every_chunk_shares_one_program(model, ar, monkeypatch):
    """Chunks of 2 requests whose own prompt widths differ (32, 16, 32 after rounding) still run
    one compiled program; per-request and summary stats are those of the outputs."""
    monkeypatch.setattr(request_run, "QUEUE_BATCHES", 1)
    dec = Decoder(model, NO_EOS, DecodeOptions("lossless", 3, max_groups=2))
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


# ---- calibration's choice -------------------------------------------------------------------

def test_calibrate_keeps_ar_unless_a_trial_decode_wins_by_the_margin(model, monkeypatch):
    """The real decodes decide: the fastest trial is kept only if it beats AR by `margin`
    (measured 1.04x is noise: AR), and it is the measured best, not the expected best."""
    dec = Decoder(model, [1], DecodeOptions("lossless", 4, adaptive=True))
    monkeypatch.setattr(cal, "acceptance_profile", lambda *a: np.array([[0.1, 0.1, 0.1, 0.7]]))
    monkeypatch.setattr(cal, "time_decode_steps",
                        lambda model, b, cands, keep=None, kernels=None: {cal.AR: 1.0} | {c: 1.0 for c in cands})
    measured = {}
    monkeypatch.setattr(cal, "trial_speedups", lambda d, p, layouts, b, n: {x: measured[x] for x in layouts})
    cands = [(2, 2), (4, 4)]
    measured.update({(2, 2): 1.03, (4, 4): 1.04})
    assert cal.calibrate(dec, PROMPTS, [1], 8, cands) == ((1, 1, 1),)
    measured.update({(2, 2): 1.3, (4, 4): 1.1})  # (4, 4) is expected to be faster, (2, 2) was
    assert cal.calibrate(dec, PROMPTS, [1], 8, cands) == ((1, 2, 2),)


def test_trial_speedup_is_ar_time_over_layout_time(model, monkeypatch):
    dec = Decoder(model, [1], DecodeOptions("lossless", 4, adaptive=True))
    timed = {cal.AR: 2.0, (2, 2): 1.0, (4, 4): 4.0}  # seconds of the fastest decode of each

    def fastest(runs, repeats):
        assert set(runs) == set(timed) and repeats >= 1
        return timed
    monkeypatch.setattr(cal, "fastest_interleaved", fastest)
    assert cal.trial_speedups(dec, PROMPTS, [(2, 2), (4, 4)], 1, 8) == {(2, 2): 2.0, (4, 4): 0.5}


# ---- threshold and verify against naive blocks ----------------------------------------------

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
    thr = Decoder(model, NO_EOS, DecodeOptions("threshold", K, tau=0.0)).generate(PROMPTS, NEW)
    assert thr.output_ids == blocks and (thr.forwards == NEW // K).all()
    prob0 = Decoder(model, NO_EOS, DecodeOptions("verify", K, commit_rule="prob", tau_v=0.0),
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

    tau = _tau_in_widest_middle_gap(np.concatenate(step(PROMPTS)[1]))
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
    res = Decoder(model, NO_EOS, DecodeOptions("verify", K, commit_rule="prob", tau_v=tau, record_steps=True),
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
    for opts, v in ((DecodeOptions("threshold", K, tau=1.01), None),
                    (DecodeOptions("verify", K, commit_rule="prob", tau_v=1.5), verifier)):
        res = Decoder(model, eos, opts, verifier=v).generate(PROMPTS, NEW)
        assert res.output_ids == want, opts.mode
        assert list(res.forwards) == [len(o) for o in want]  # one exact token per forward
        assert (res.accept_hist.sum(1) == res.forwards).all()
        assert list(res.verifier_forwards) == (list(res.forwards) if v is not None else [0] * len(want))


# ---- lossless, step by step, against a naive ProVe-lossless ---------------------------------

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
    res = Decoder(proposer, NO_EOS, DecodeOptions("lossless", k, max_groups=groups, record_steps=True)
                  ).generate(prompts, max_new)
    assert res.output_ids == outs
    assert res.step_commits == commits
    assert res.accept_hist.tolist() == [np.bincount(a, minlength=k + 1).tolist() for a in accepted]
