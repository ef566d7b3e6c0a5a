"""Decoding engine: every lossless mode must equal greedy AR token for token.

Oracles: transformers `generate(do_sample=False)` for AR; our AR for the lossless modes.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from prove_jax.checkpoints.checkpoint import load_model, save_model
from prove_jax.models.config import ConfigError
from prove_jax.checkpoints.convert import hf_to_flax
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, ComputeOptions, program, queue, LosslessRule, MemoryLayout, ThresholdRule, VerifyRule
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.mode_steps import head_in_one_pass
from prove_jax.models.compute import DEFAULT_COMPUTE
from prove_jax.models.attention import StepMask, causal_mask
from prove_jax.models.qwen2 import Qwen2
from prove_jax.models.params import create_model
from prove_jax.models.sharding import make_mesh
from tests.decode_helpers import CFG, ROOT, load_or_shard, random_prompts, tau_in_widest_middle_gap
from tests.hf_models import hf_greedy, make_hf_qwen2
from tests.vocab_helpers import with_rows

@pytest.fixture(scope="module")
def ar_out(model):
    return Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts(), 24)


def test_ar_matches_transformers_generate(tmp_path):
    hf = make_hf_qwen2(tmp_path / "hf", seed=1, eos_token_id=5)
    hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    prompts = random_prompts(1, (5, 11, 2, 17))
    res = Decoder(ours, [5], DecodeOptions("ar")).generate(prompts, 20)
    assert res.output_ids == hf_greedy(hf, prompts, 20, eos_id=5)


def test_chunked_prefill_matches_transformers_generate(tmp_path, monkeypatch):
    """Prompts spanning several prefill chunks (and rows needing different chunk counts)."""
    from prove_jax.decoding import options as decode_options
    monkeypatch.setattr(decode_options, "PREFILL_CHUNK", {jax.default_backend(): 8})
    assert decode_options.default_prefill_chunk() == 8
    hf = make_hf_qwen2(tmp_path / "hf", seed=2, eos_token_id=5)
    hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    prompts = random_prompts(2, (5, 23, 8, 40))
    refs = hf_greedy(hf, prompts, 12, eos_id=5)
    for rows in (4, 2):  # a static batch, and a queue whose admitted rows prefill alone
        assert Decoder(ours, [5], DecodeOptions("ar")).generate(prompts, 12, batch_size=rows).output_ids == refs
    # lossless over multi-chunk prompts still equals our AR (the HF model has no <|mask|>)
    model = create_model(CFG, seed=3)
    long_prompts = random_prompts(3, (5, 23, 8, 40))
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(long_prompts, 20)
    lossless = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))).generate(long_prompts, 20, batch_size=2)
    assert lossless.output_ids == ar.output_ids
    # an explicit chunk (DecodeOptions.memory.prefill_chunk) overrides the default: same outputs, and
    # the prefill forwards (traced) take that many tokens
    widths, real = [], Qwen2.hidden_states

    def spy(self, tokens, *a, **kw):
        widths.append(tokens.shape[1])
        return real(self, tokens, *a, **kw)
    monkeypatch.setattr(Qwen2, "hidden_states", spy)
    for chunk in (3, 16):
        widths.clear()
        assert Decoder(ours, [5], DecodeOptions("ar", memory=MemoryLayout(prefill_chunk=chunk))).generate(prompts, 12).output_ids == refs
        assert widths[0] == chunk and 8 not in widths
    with pytest.raises(DecodeError, match="prefill chunk must be >= 1"):
        DecodeOptions("ar", memory=MemoryLayout(prefill_chunk=0)).validate()


def test_buffer_read_in_chunks_matches_transformers_generate(tmp_path):
    """A buffer long enough to be read in chunks (`model.cache_chunk`: 512 slots and the step's
    width, two chunks) is attended chunk by chunk up to the batch's longest row; rows of 480, 40
    and 450 prompt tokens still decode exactly as transformers does, and lossless equals AR."""
    from prove_jax.models.attention import cache_chunk
    hf = make_hf_qwen2(tmp_path / "hf", seed=4, eos_token_id=5)
    hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    prompts = random_prompts(4, (480, 40, 450))
    dec = Decoder(ours, [5], DecodeOptions("ar"))
    slots = program.cache_slots(dec.buffer_len(480, 12) + 1)  # the AR cache: buffer + one step
    assert cache_chunk(slots) < slots
    assert dec.generate(prompts, 12).output_ids == hf_greedy(hf, prompts, 12, eos_id=5)
    model = create_model(CFG, seed=3)
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(prompts, 16)
    lossless = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))).generate(prompts, 16)
    assert lossless.output_ids == ar.output_ids


def test_a_large_batch_reads_a_short_buffer_in_short_chunks(tmp_path):
    """On CPU, from `model.CPU_SHORT_CHUNK_ROWS` rows up, a buffer too short for two 256-slot
    chunks is read in two shorter ones (a single row reads it in one pass): 16 rows of 20-250
    prompt tokens decode exactly as transformers does, the compiled loop slices chunks of that
    size from the cache, and lossless equals AR."""
    import re
    from prove_jax.models.attention import CPU_SHORT_CHUNK_ROWS, cache_chunk
    hf = make_hf_qwen2(tmp_path / "hf", seed=6, eos_token_id=5)
    hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    rows = CPU_SHORT_CHUNK_ROWS
    prompts = random_prompts(6, np.linspace(20, 250, rows).astype(int))
    dec = Decoder(ours, [5], DecodeOptions("ar"))
    slots = program.cache_slots(dec.buffer_len(256, 8) + 1)  # prompts pad to 256; AR: + one step
    chunk = cache_chunk(slots, rows=rows)
    assert chunk < slots == cache_chunk(slots)
    assert dec.generate(prompts, 8).output_ids == hf_greedy(hf, prompts, 8, eos_id=5)
    ((_, compiled),) = dec.programs("run")
    cfg = ours.cfg
    assert re.search(rf"f32\[{rows},{cfg.num_kv_heads},{chunk},{cfg.head_dim}\]", compiled.as_text())
    model = create_model(CFG, seed=3)
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(prompts, 12)
    lossless = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))).generate(prompts, 12)
    assert lossless.output_ids == ar.output_ids


@pytest.mark.parametrize("k,groups", [(4, None), (5, 2), (3, 1), (6, 3)])
def test_lossless_equals_ar_random_proposer(model, ar_out, k, groups):
    res = Decoder(model, [1], DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=groups))).generate(random_prompts(), 24)
    assert res.output_ids == ar_out.output_ids
    assert (res.accept_hist.sum(1) == res.forwards).all()


def test_lossless_reads_the_lm_head_once_where_few_extra_rows(model, ar_out, monkeypatch):
    """K=5, G=2 needs the head at 9 of its 13 slots: one pass over all 13 for one row (4 extra
    rows), two passes (the 5 verify slots, then the chosen group's 4) for four rows (16 extra).
    With one group every slot is needed: one pass. `ComputeOptions(lm_head_one_pass=False)`
    forces two passes for one row too. All of them are AR."""
    widths = []
    real = Qwen2.logits

    def spy(self, hidden, **kw):
        widths.append(hidden.shape[1])
        return real(self, hidden, **kw)
    monkeypatch.setattr(Qwen2, "logits", spy)
    two_passes = ComputeOptions(lm_head_one_pass=False)
    for k, groups, rows, compute, head_widths in [(5, 2, 1, DEFAULT_COMPUTE, [13]), (5, 2, 4, DEFAULT_COMPUTE, [5, 4]),
                                                  (3, 1, 4, DEFAULT_COMPUTE, [5]), (5, 2, 1, two_passes, [5, 4])]:
        assert head_in_one_pass(LosslessLayout.build(k, groups), rows, compute) == (len(head_widths) == 1)
        widths.clear()
        dec = Decoder(model, [1], DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=groups), compute=compute))
        assert dec.generate(random_prompts(), 24, batch_size=rows).output_ids == ar_out.output_ids
        assert widths == head_widths


def test_lossless_layout_serves_at_most_the_real_drafts():
    """K=3, groups serving 0 and full acceptance: row 0 has both drafts real, row 1 only one
    (its previous step committed a shifted block), so its top group serves 1 and sits one
    position earlier, seeing t0 and d_1 only."""
    layout = LosslessLayout.build(3, 2)  # [t0, d1, d2, g0 m0, g0 m1, g1 m0, g1 m1]
    served = layout.served(jnp.asarray([2, 1]))
    assert served.tolist() == [[0, 2], [0, 1]]
    assert layout.offsets(served).tolist() == [[0, 1, 2, 1, 2, 3, 4], [0, 1, 2, 1, 2, 2, 3]]
    intra = np.asarray(layout.intra_mask(served)).astype(int)
    causal = np.tril(np.ones((2, 2), int))
    for row, j in enumerate((2, 1)):
        want = np.zeros((7, 7), int)
        want[:3, :3] = np.tril(np.ones((3, 3), int))
        want[3:5, :1] = 1  # group 0: t0
        want[3:5, 3:5] = causal
        want[5:7, : j + 1] = 1  # top group: t0, d_1..d_j
        want[5:7, 5:7] = causal
        assert (intra[row] == want).all(), row


def _eos_inside_output(ar_out):
    """A token that AR emits mid-stream: used as EOS, generation must stop right after it."""
    out = ar_out.output_ids[1]
    return out[len(out) // 2]


def test_lossless_and_verify_stop_at_eos_like_ar(model, ar_out):
    eos = _eos_inside_output(ar_out)
    ar = Decoder(model, [eos], DecodeOptions("ar")).generate(random_prompts(), 24)
    assert any(len(o) < 24 and o[-1] == eos for o in ar.output_ids)
    for opts in (DecodeOptions("lossless", 4), DecodeOptions("verify", 4)):
        res = Decoder(model, [eos], opts, verifier=model).generate(random_prompts(), 24)
        assert res.output_ids == ar.output_ids, opts.mode
        if opts.mode == "verify":
            assert_hist_counts_committed_tokens(res)


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_inside_block(model, ar_out, max_new):
    res = Decoder(model, [1], DecodeOptions("lossless", 4)).generate(random_prompts(), max_new)
    assert res.output_ids == [o[:max_new] for o in ar_out.output_ids]
    thr = Decoder(model, [1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.0))).generate(random_prompts(), max_new)
    assert all(len(o) == max_new for o in thr.output_ids)
    assert_hist_counts_committed_tokens(thr)


def test_buffer_nearly_full(model):
    # prompt width rounds to 48 and 48 + 16 = 64 = the buffer: the last step writes at its end
    prompts = random_prompts(2, (47, 33))
    dec_ar = Decoder(model, [1], DecodeOptions("ar"))
    assert dec_ar.buffer_len(48, 16) == 64
    ar = dec_ar.generate(prompts, 16)
    res = Decoder(model, [1], DecodeOptions("lossless", 6)).generate(prompts, 16)
    assert res.output_ids == ar.output_ids


def test_verify_with_proposer_as_verifier_equals_ar(model, ar_out):
    res = Decoder(model, [1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="top1")),
                  verifier=model).generate(random_prompts(), 24)
    assert res.output_ids == ar_out.output_ids
    assert (res.verifier_forwards == res.forwards).all()
    assert_hist_counts_committed_tokens(res)


def test_verifier_may_pad_its_vocabulary_to_other_rows_than_the_proposer(model, ar_out):
    """The paper's pair, Qwen2.5-32B and -3B, has 152,064 and 151,936 rows for one tokenizer."""
    more = with_rows(model, 128)
    for proposer, verifier in ((model, more), (more, model)):
        res = Decoder(proposer, [1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="top1")),
                      verifier=verifier).generate(random_prompts(), 24)
        assert res.output_ids == ar_out.output_ids
    # the verifier reads the prompts too: their ids must be within its rows
    dec = Decoder(more, [1], DecodeOptions("verify", 4), verifier=model)
    with pytest.raises(DecodeError, match=r"prompt 0 has token id 100 outside the vocabulary "
                                          r"\[0, 96\) \(the verifier has 96 embedding rows\)"):
        dec.generate([[2, 100]], 4)
    Decoder(more, [1], DecodeOptions("ar")).check_prompts([[2, 100]], 4)  # the proposer alone has it


@pytest.mark.parametrize("copy_of,scale", [(7, 1.5), (14, 1.2)])
def test_a_proposed_token_past_the_verifier_rows_is_never_accepted_nor_poisons_it(model, copy_of, scale):
    """A proposer with more rows emits ids the verifier has none for: as exact tokens D_0 (which
    are always committed) or as drafts. The verifier reads them as 0 and rejects the drafts;
    fed as they are, they gathered NaN into its cache and it then rejected everything."""
    eager = with_rows(model, 128, copy_of, scale)
    # tau_v = 0 accepts every draft the verifier can read
    res = Decoder(eager, [1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="prob", tau_v=0.0), record_steps=True),
                  verifier=model).generate(random_prompts(), 24)
    past, after_past = 0, []  # exact tokens past the rows; commits of the steps after one
    for out, commits in zip(res.output_ids, res.step_commits):
        start, row_past = 0, False
        for n in commits:
            block = out[start:start + n]
            assert all(t < 96 for t in block[1:]), block  # drafts past its rows: never accepted
            if row_past:
                after_past.append(n)
            row_past |= block[0] >= 96
            past += block[0] >= 96
            start += n
    assert past > 0  # the case arises
    if copy_of == 7:  # exact tokens past the rows, drafts within them: the verifier still accepts
        assert max(after_past) == 4


def test_threshold_tau_above_one_is_ar_and_lower_tau_commits_more(model, ar_out):
    strict = Decoder(model, [1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=1.01))).generate(random_prompts(), 24)
    assert strict.output_ids == ar_out.output_ids
    assert (strict.forwards == 24).all()
    loose = Decoder(model, [1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.0))).generate(random_prompts(), 24)
    assert (loose.forwards < strict.forwards).all()


def test_verify_gated_by_the_proposers_confidence(model, ar_out):
    """gate_tau: a draft is committed only where the verifier's rule and the proposer's own
    confidence both pass. With a verifier that accepts everything (prob, tau_v 0) the gate alone
    decides, which is threshold's rule at the same tau; a gate no draft passes commits AR's
    first token alone; gate 0 leaves the verifier's commits as they were."""
    verifier = create_model(CFG.replace(num_layers=1, mask_token_id=None), seed=5)
    prompts = random_prompts()

    def verify(**kw):
        return Decoder(model, [1], DecodeOptions("verify", 4, verify=VerifyRule(**kw)), verifier=verifier).generate(prompts, 24)
    threshold = Decoder(model, [1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.3))).generate(prompts, 24)
    gated = verify(commit_rule="prob", tau_v=0.0, gate_tau=0.3)
    assert gated.output_ids == threshold.output_ids
    np.testing.assert_array_equal(gated.forwards, threshold.forwards)
    strict = verify(commit_rule="prob", tau_v=0.0, gate_tau=1.01)
    assert strict.output_ids == ar_out.output_ids and (strict.forwards == 24).all()
    assert verify(gate_tau=0.0).output_ids == verify().output_ids
    with pytest.raises(DecodeError, match="gate_tau gates verify"):
        DecodeOptions("lossless", 4, verify=VerifyRule(gate_tau=0.5)).validate()


def _oracle_confidence(logits: np.ndarray, kind: str) -> np.ndarray:
    """numpy: top-1 probability, top-1 minus top-2 probability, or entropy (nats) per row."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(p, axis=-1)
    return {"prob": top[..., -1], "margin": top[..., -1] - top[..., -2],
            "entropy": -(p * np.log(p)).sum(-1)}[kind]




@pytest.mark.parametrize("kind", ["prob", "margin", "entropy"])
def test_threshold_confidence_kinds_accept_as_transformers_logits_say(tmp_path, kind):
    """First threshold step of each row against an oracle from HF logits over [prompt, masks]:
    the block is their argmax and the commit length 1 + the passing prefix of D_1..D_{K-1}
    (prob/margin >= tau, entropy <= tau)."""
    k, mask = 4, 250
    hf = make_hf_qwen2(tmp_path / "hf", seed=4, mask_token_id=mask, initializer_range=0.2)
    hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    prompts = random_prompts(4, (5, 11, 2, 17, 8, 3))
    blocks, confs = [], []
    for p in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([p + [mask] * (k - 1)])).logits[0, len(p) - 1:].double().numpy()
        blocks.append(logits.argmax(-1).tolist())
        confs.append(_oracle_confidence(logits[1:], kind))
    tau = tau_in_widest_middle_gap(np.concatenate(confs))
    passes = [(c <= tau) if kind == "entropy" else (c >= tau) for c in confs]
    expected = [1 + int(np.cumprod(ok).sum()) for ok in passes]
    assert min(expected) < k and max(expected) > 1  # the threshold decides something here
    res = Decoder(ours, [-1], DecodeOptions("threshold", k, threshold=ThresholdRule(tau=tau, confidence=kind), record_steps=True)
                  ).generate(prompts, 8)
    assert [c[0] for c in res.step_commits] == expected
    for out, block, n in zip(res.output_ids, blocks, expected):
        assert out[:n] == block[:n]


def test_stats_are_consistent(model):
    """accept_hist has one entry per proposer forward. threshold and verify count steps by tokens
    committed, so sum(i * hist[i]) is the tokens generated: they counted the accepted length
    before the max-new-tokens cut, and here every row's last step accepts 4 (tau 0 / tau_v 0
    accept every draft) but has room for 3 of 23. lossless counts steps by drafts matching AR
    (a, before the cut: what calibration reads), so only its last step may commit fewer than
    a + 1 (group caps never lower it: every verified token commits)."""
    for opts in (DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.0)), DecodeOptions("lossless", 4),
                 DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="prob", tau_v=0.0))):
        res = Decoder(model, [1], opts, verifier=model if opts.mode == "verify" else None
                      ).generate(random_prompts(), 23)
        assert (res.accept_hist.sum(1) == res.forwards).all()
        generated = np.array([len(o) for o in res.output_ids])
        if opts.mode == "lossless":
            upper = (res.accept_hist * (1 + np.arange(res.accept_hist.shape[1]))).sum(1)
            assert ((upper - generated >= 0) & (upper - generated < 4)).all()
            assert (generated >= res.forwards).all()
        else:
            assert_hist_counts_committed_tokens(res)


def assert_hist_counts_committed_tokens(res):
    generated = np.array([len(o) for o in res.output_ids])
    committed = (res.accept_hist * np.arange(res.accept_hist.shape[1])).sum(1)
    assert committed.tolist() == generated.tolist()
    assert res.accept_hist[:, 0].sum() == 0  # an active step commits at least one token


def test_compiled_once_per_shape(model):
    dec = Decoder(model, [1], DecodeOptions("lossless", 4))
    dec.generate(random_prompts(0), 16)
    dec.generate(random_prompts(5), 16)  # same batch, prompt width bucket and buffer
    assert dec.trace_count == 1
    dec.generate(random_prompts(0)[:2], 16)  # new batch size -> one more program
    assert dec.trace_count == 2


@pytest.mark.parametrize("kernels_a,kernels_b", [
    (ComputeOptions(matmul_form="weight_major"), ComputeOptions(matmul_form="plain")),
    (ComputeOptions(lm_head_one_pass=True), ComputeOptions(lm_head_one_pass=False)),
], ids=["matmul-form", "lm-head-passes"])
def test_kernel_options_key_the_compiled_program(model, ar_out, monkeypatch, kernels_a, kernels_b):
    """Two DecodeOptions that differ only in their kernels, in one process: two traces, two
    cache entries whose keys differ only there, two different compiled programs, the same
    tokens. (When the kernels were module globals read at trace time, a decoder reused a
    program compiled under one setting when asked for the other.)"""
    traces = []
    real = program.run_program
    monkeypatch.setattr(program, "run_program", lambda *a, **kw: traces.append(a[3]) or real(*a, **kw))
    base = DecodeOptions("lossless", 5, lossless=LosslessRule(max_groups=2))  # at one row: the LM head in one pass by default
    first = Decoder(model, [1], dataclasses.replace(base, compute=kernels_a))
    second = first.with_options(dataclasses.replace(base, compute=kernels_b))
    results = [dec.generate(random_prompts(), 24, batch_size=1) for dec in (first, second)]
    assert len(traces) == 2 and [dec.trace_count for dec in (first, second)] == [1, 1]
    (key_a, compiled_a), = first.programs("run")
    (key_b, compiled_b), = second.programs("run")
    assert key_a != key_b and key_a[2:] == key_b[2:]  # ("run", settings, shapes...)
    settings_a, settings_b = key_a[1], key_b[1]
    assert (settings_a.options.compute, settings_b.options.compute) == (kernels_a, kernels_b)
    assert dataclasses.replace(settings_a, options=dataclasses.replace(settings_a.options, compute=kernels_b)) == settings_b
    assert compiled_a.as_text() != compiled_b.as_text()
    assert results[0].output_ids == results[1].output_ids == ar_out.output_ids
    assert [r.options.compute for r in results] == [kernels_a, kernels_b]


def _queue_arrays(prompts, width=16, max_new=8):
    """(prompts [Q, width], prompt_len [Q], max_new [Q]) as `Decoder.generate` lays them out."""
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return (jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32),
            jnp.full((len(prompts),), max_new, jnp.int32))


def test_prefill_then_one_step_gives_the_uncached_forwards_logits(model):
    """`program.prefill` alone: prompts of 3-14 tokens written 4 at a time (1 to 4 chunks per
    row). A one-token step of each prompt's last token against that cache gives the logits a
    plain causal forward without a cache gives at that position, and the prompts' KV equals a
    single-chunk prefill's."""
    prompts, prompt_len, _ = _queue_arrays(random_prompts(8, (3, 9, 14, 5)))
    rows, width = prompts.shape
    cache = program.prefill(model, prompts, prompt_len, 32, chunk_size=4, pad_id=0)
    last = prompt_len - 1
    hidden, _ = model.hidden_states(prompts[jnp.arange(rows), last][:, None], last[:, None],
                                    StepMask(last, causal_mask(1, 1)), cache)
    step_logits = model.logits(hidden)[:, 0]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    full_logits, _ = model(prompts, positions, causal_mask(rows, width))
    np.testing.assert_allclose(step_logits, full_logits[jnp.arange(rows), last], rtol=1e-5, atol=1e-5)
    one_chunk = program.prefill(model, prompts, prompt_len, 32, chunk_size=width, pad_id=0)
    for chunked, whole in zip(cache.k + cache.v, one_chunk.k + one_chunk.v):  # [B, K, S, Dh]
        for r, n in enumerate(prompt_len.tolist()):
            np.testing.assert_allclose(chunked[r, :, :n], whole[r, :, :n], rtol=1e-5, atol=1e-6)


def test_admitting_a_request_into_a_row_equals_starting_it_there(model):
    """`program.admit` alone: a batch started with requests 0 and 1, then request 2 admitted
    into row 1 (`queue.put_row`), holds the state of a batch started with requests 0 and 2:
    tokens, lengths, budgets, counters, drafts exactly, and both caches over the prompts."""
    prompts, prompt_len, max_new = _queue_arrays(random_prompts(9, (5, 3, 14)))
    stop_ids = jnp.asarray([[1, -1], [1, 7], [1, 9]], jnp.int32)
    requests = queue.Requests(prompts, prompt_len, max_new, stop_ids, sampling=None)
    options = DecodeOptions("verify", 4, record_steps=True, logprobs=2).validate()
    settings = program.ProgramSettings(options=options, num_rows=2, num_slots=64, pad_id=0,
                                       mask_id=CFG.mask_token_id, prefill_chunk=4)
    batch = program.start_rows(model, model, requests.rows(0, 2), settings)
    row = program.admit(model, model, requests, jnp.int32(2), batch, jnp.int32(1), settings)
    admitted = queue.put_row(batch.replace(step=jnp.int32(5)), row, jnp.int32(1))
    pick = jnp.asarray([0, 2])
    fresh = program.start_rows(model, model, jax.tree.map(lambda x: x[pick], requests), settings)
    assert int(admitted.step) == 5  # the loop counter is the batch's
    admitted = admitted.replace(step=fresh.step)
    for name in ("cache", "verifier_cache"):
        got, want = getattr(admitted, name), getattr(fresh, name)
        for a, b in zip(got.k + got.v, want.k + want.v):
            for r, n in enumerate(prompt_len[pick].tolist()):  # past a prompt: padding, overwritten
                np.testing.assert_allclose(a[r, :, :n], b[r, :, :n], rtol=1e-5, atol=1e-6)
    rest = lambda state: state.replace(cache=None, verifier_cache=None)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(rest(admitted))
    assert [path for path, _ in leaves] == [path for path, _ in jax.tree_util.tree_leaves_with_path(rest(fresh))]
    assert len(leaves) >= 12
    for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(rest(fresh))):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_sharded_decoding_equals_single_device(model, ar_out, monkeypatch):
    from prove_jax.models import attention as model_lib
    mesh = make_mesh((4, 1, 2))
    sharded = load_or_shard(model, mesh)
    prompts = random_prompts() * 2
    for opts in (DecodeOptions("ar"), DecodeOptions("lossless", 4)):
        res = Decoder(sharded, [1], opts, mesh=mesh).generate(prompts, 24)
        assert res.output_ids == ar_out.output_ids * 2, opts.mode
    # a buffer read in chunks (512 slots and a step: model.cache_chunk) on the mesh too
    long = random_prompts(5, (480, 40, 450, 7))
    want = Decoder(model, [1], DecodeOptions("ar")).generate(long, 8).output_ids
    chunk_rows = []  # the chunk rule sizes one device's work: 4 rows over 4 data shards is 1 each
    unpatched = model_lib.cache_chunk
    monkeypatch.setattr(model_lib, "cache_chunk",
                        lambda slots, rows=1, platform=None: chunk_rows.append(rows) or unpatched(slots, rows, platform))
    for opts in (DecodeOptions("ar"), DecodeOptions("lossless", 4)):
        assert Decoder(sharded, [1], opts, mesh=mesh).generate(long, 8).output_ids == want, opts.mode
    assert chunk_rows and set(chunk_rows) == {1}




def test_bad_requests(model):
    dec = Decoder(model, [1], DecodeOptions("ar"), max_buffer=64)
    with pytest.raises(DecodeError, match="longer than the buffer"):
        dec.generate([[2] * 60], 10)
    with pytest.raises(DecodeError, match="empty"):
        dec.generate([[2, 3], []], 4)
    with pytest.raises(DecodeError, match="unknown mode"):
        Decoder(model, [1], DecodeOptions("beam"))
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        CFG.replace(dtype="fp8")
    with pytest.raises(DecodeError, match="tau must be a finite number"):
        Decoder(model, [1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=float("nan"))))
    with pytest.raises(DecodeError, match="tau_v .* >= 0"):
        Decoder(model, [1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="prob", tau_v=-0.1)), verifier=model)
    assert [DecodeOptions("threshold", threshold=ThresholdRule(confidence=c)).validate().threshold.tau for c in ("prob", "margin", "entropy")
            ] == [0.9, 0.8, 0.5]
    with pytest.raises(DecodeError, match="mask"):
        Decoder(create_model(CFG.replace(mask_token_id=None)), [1], DecodeOptions("lossless", 4))


def test_a_step_wider_than_the_buffer_is_refused_before_tracing(model):
    # 1 + 39 x 41 tokens per step, beyond a 64-slot buffer: the error names the layout and the fix
    with pytest.raises(DecodeError, match=r"lossless K=40 with 40 mask groups feeds 1600 tokens per step "
                                          r"\(1 \+ 39 x 41\), more than the model's 64-position buffer; "
                                          r"lower --block-size or cap the groups with --groups"):
        Decoder(model, [1], DecodeOptions("lossless", 40), max_buffer=64)
    with pytest.raises(DecodeError, match=r"--block-size 40 feeds 79 tokens per step"):
        Decoder(model, [1], DecodeOptions("threshold", 40), max_buffer=64)
    with pytest.raises(DecodeError, match="4096-token step limit"):
        Decoder(model, [1], DecodeOptions("lossless", 100), max_buffer=1 << 20)
    dec = Decoder(model, [1], DecodeOptions("lossless", 40, lossless=LosslessRule(max_groups=1)), max_buffer=80)  # 79 wide: fits
    with pytest.raises(DecodeError, match="1600 tokens per step"):
        dec.with_options(DecodeOptions("lossless", 40))
    assert dec.trace_count == 0


def test_free_device_memory_reads_the_allocator_or_the_host_never_host_ram_for_an_accelerator():
    import types
    from prove_jax import memory
    gpu = lambda stats: types.SimpleNamespace(platform="gpu", memory_stats=lambda: stats)
    assert memory.free_device_memory(gpu({"bytes_limit": 10 << 30, "bytes_in_use": 3 << 30})) == 7 << 30
    assert memory.free_device_memory(gpu(None)) is None  # unknown: the check is skipped
    assert memory.free_device_memory(gpu({"bytes_in_use": 1})) is None
    host = memory.free_device_memory(types.SimpleNamespace(platform="cpu", memory_stats=lambda: None))
    assert host is not None and host > 64 << 20


def test_a_decode_that_cannot_fit_in_memory_is_refused_before_it_runs(tmp_path, model, monkeypatch, capsys):
    from prove_jax.cli import generate
    from prove_jax import memory
    dec = Decoder(model, [1], DecodeOptions("lossless", 4))
    compiled = []
    real_check = memory.check_fits
    monkeypatch.setattr(memory, "check_fits", lambda c, *a, **k: (compiled.append(c), real_check(c, *a, **k)))
    dec.generate(random_prompts(), 16)  # fits: the host has far more than this program needs
    need = memory.program_memory(compiled[0])
    assert need > 2 * 4 * 2 * 2 * 64 * 8 * 4  # at least the KV of 4 rows x 64 slots x 2 layers
    monkeypatch.setattr(memory, "free_device_memory", lambda device: need)
    dec.generate(random_prompts(), 16)  # exactly enough
    monkeypatch.setattr(memory, "free_device_memory", lambda device: need // 2)
    with pytest.raises(DecodeError, match=r"decoding 4 rows x 64 cache slots \(KV .*\) needs 0\.\d+ GiB, "
                                          r"but the host has 0\.\d+ GiB free: lower --batch-size"):
        dec.generate(random_prompts(), 16)
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 1024)
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4, 5]}) + "\n")
    # an explicit mesh: the default one would refuse the weights first (tests/decoding/test_inference_mesh.py)
    assert generate.main(["--model", ckpt, "--mode", "ar", "--input", str(inp), "--output", str(out),
                          "--max-new-tokens", "8", "--mesh", "8,1,1"]) == 2
    assert "needs" in capsys.readouterr().err and not out.exists()


def test_cli_lossless_in_bfloat16_says_it_is_exact_only_up_to_rounding(tmp_path, model, capsys):
    from prove_jax.cli import generate
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4, 5]}) + "\n")
    common = ["--model", ckpt, "--input", str(inp), "--output", str(out), "--max-new-tokens", "4"]
    assert generate.main(common + ["--mode", "lossless", "--dtype", "bfloat16"]) == 0
    assert "near-tie can flip" in capsys.readouterr().err
    assert len(json.loads(out.read_text())["output_ids"]) == 4
    assert generate.main(common + ["--mode", "lossless", "--overwrite"]) == 0  # float32: exact, nothing to say
    assert "near-tie" not in capsys.readouterr().err


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "infer.generate", *args], cwd=ROOT,
                          capture_output=True, text=True, env=os.environ | {"PYTHONPATH": ROOT})


def test_cli_end_to_end_and_errors(tmp_path, model, capsys):
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p}) + "\n"
                           for i, p in enumerate(random_prompts())))
    out = tmp_path / "out.jsonl"
    r = _cli("--model", ckpt, "--mode", "lossless", "--input", str(inp), "--output", str(out),
             "--max-new-tokens", "24", "--batch-size", "3", "--sort")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"wrote 4 records to {out}"
    assert "loading " in r.stderr and "compiling the decode step" in r.stderr  # no silent minutes
    assert "[4/4 requests]" in r.stderr  # stderr is not a terminal: plain progress lines
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts(), 24)
    assert [row["output_ids"] for row in rows] == ar.output_ids
    assert [row["id"] for row in rows] == ["r0", "r1", "r2", "r3"]
    summary = json.loads(r.stderr.strip().splitlines()[-2])
    assert summary["generated_tokens"] == sum(len(o) for o in ar.output_ids)

    # the errors in-process (the same `main`; a subprocess each cost seconds of start-up)
    from prove_jax.cli import generate

    def fails(*args, expect):
        try:
            rc = generate.main([*args, "--output", str(bad)])
        except SystemExit as e:  # argparse's refusals, as the subprocess would exit
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and expect in err and "Traceback" not in err, err
        assert not bad.exists()

    bad = tmp_path / "bad.jsonl"
    for case, expect in [
        (["--model", str(tmp_path / "missing")], "checkpoint not found"),
        (["--model", ckpt, "--mode", "nope"], "invalid choice: 'nope'"),
        (["--model", ckpt, "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--model", ckpt, "--mode", "lossless", "--block-size", "0"], "--block-size must be >= 1"),
        (["--model", ckpt, "--mode", "lossless", "--block-size", "500"],
         "lossless K=500 with 500 mask groups feeds 250000 tokens per step"),
    ]:
        fails(*case, "--input", str(inp), expect=expect)
    text = tmp_path / "text.jsonl"  # a text prompt: the missing model is named, not its tokenizer
    text.write_text(json.dumps({"id": 0, "prompt": "def f():"}) + "\n")
    fails("--model", str(tmp_path / "missing"), "--input", str(text), expect="error: model checkpoint not found")
    fails("--model", ckpt, "--input", str(tmp_path), expect="is a directory; give a JSON Lines file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": 0, "prompt_ids": []}) + "\n")
    fails("--model", ckpt, "--input", str(empty), "--strict", expect="empty")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": 0, "prompt_ids": [3] * 600}) + "\n")
    fails("--model", ckpt, "--input", str(long), "--max-new-tokens", "32500", "--strict",
          expect="longer than the buffer")


def test_one_bad_request_fails_alone(tmp_path, model, capsys):
    """Without --strict, requests whose prompt is missing, malformed, empty, out of vocabulary or
    too long get an 'error' record and the rest decode as they would alone (oracle: AR on the
    good prompts by themselves); the exit status says some failed. --strict stops at the first."""
    from prove_jax.cli import generate
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    good = random_prompts()
    lines = [{"id": "g0", "prompt_ids": good[0]}, {"id": "empty", "prompt_ids": []},
             {"id": "g1", "prompt_ids": good[1]}, {"id": "typed", "prompt": 7},
             {"id": "vocab", "prompt_ids": [3, CFG.vocab_size]}, {"prompt_ids": good[2]},
             {"id": "long", "prompt_ids": [3] * CFG.max_position_embeddings}, {"id": "none"}, {"id": "g3", "prompt_ids": good[3]}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--model", ckpt, "--mode", "lossless", "--input", str(inp), "--output", str(out),
              "--max-new-tokens", "24", "--batch-size", "2", "--sort"]
    assert generate.main(common) == generate.SOME_REQUESTS_FAILED
    err = capsys.readouterr().err
    assert "error: 5 of 9 requests failed" in err and json.loads(err.splitlines()[-2])["failed"] == 5
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["g0", "empty", "g1", "typed", "vocab", 5, "long", "none", "g3"]
    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert set(errors) == {"empty", "typed", "vocab", "long", "none"}
    assert "'prompt_ids' is empty" in errors["empty"] and "in.jsonl:2" in errors["empty"]
    assert "'prompt' must be a string" in errors["typed"]
    assert f"token id {CFG.vocab_size} outside the vocabulary" in errors["vocab"]
    assert "longer than the buffer" in errors["long"]
    assert "needs 'prompt' (text) or 'prompt_ids'" in errors["none"]
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(good, 24)
    assert [r["output_ids"] for r in rows if "error" not in r] == ar.output_ids
    assert generate.main(common + ["--strict"]) == 2
    assert "error: " in capsys.readouterr().err


def test_adaptive_shrinks_width_with_batch_and_falls_back_to_ar(model, ar_out):
    from prove_jax.decoding import adapt_for_batch
    opts = DecodeOptions("lossless", 8, lossless=LosslessRule(adaptive=True))
    widths = [adapt_for_batch(opts, b, "gpu") for b in (1, 4, 8, 16, 32, 64)]
    ks = [o.block_size for o in widths]
    assert ks == sorted(ks, reverse=True) and ks[0] == 8
    assert widths[-1].mode == "ar" and widths[-1].block_size == 1
    assert adapt_for_batch(opts, 1, "cpu").mode == "ar"  # wide steps never pay on CPU here
    res = Decoder(model, [1], opts).generate(random_prompts(), 24)
    assert res.output_ids == ar_out.output_ids


def test_truncate_a_long_prompt_and_say_when_adaptive_chose_ar(tmp_path, capsys):
    """--truncate left keeps a too-long prompt's end, right its start (oracle: AR on the cut
    prompt); without it the error says how to fix it. --adaptive on CPU (whose table is AR) says
    in a plain line that it ran AR."""
    from prove_jax.cli import generate
    short = create_model(CFG.replace(max_position_embeddings=64), seed=3)
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, short)
    prompt = np.random.RandomState(1).randint(2, 90, 60).tolist()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "p", "prompt_ids": prompt}) + "\n")
    common = ["--model", ckpt, "--input", str(inp), "--output", str(out), "--max-new-tokens", "8"]
    assert generate.main(common) == generate.SOME_REQUESTS_FAILED
    error = json.loads(out.read_text())["error"]
    assert "lower max_new_tokens to 4 or shorten the prompt" in error and "--truncate" in error
    ar = Decoder(short, [1], DecodeOptions("ar"))
    for side, cut in (("left", prompt[-56:]), ("right", prompt[:56])):
        out.unlink()  # else the rerun finds the request done
        assert generate.main(common + ["--truncate", side]) == 0
        assert json.loads(out.read_text())["output_ids"] == ar.generate([cut], 8).output_ids[0]
    capsys.readouterr()
    out.unlink()
    assert generate.main(common + ["--truncate", "left", "--mode", "lossless", "--adaptive"]) == 0
    assert "note: --adaptive chose plain AR for batch size 1 on this CPU" in capsys.readouterr().err
