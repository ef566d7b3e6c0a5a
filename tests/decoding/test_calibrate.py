"""Calibrated adaptive lossless: the acceptance model, the choice, and the decoder using it."""

import json

import numpy as np
import pytest

from prove_jax import assets, timing
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.cli import generate
from prove_jax.data.corpus import build_corpus, heldout_prompts
from prove_jax.checkpoints.checkpoint import load_tokenizer
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, LosslessRule
from prove_jax.decoding import calibrate as cal
from prove_jax.decoding import step_timing
from prove_jax.decoding.adaptive import check_adaptive_table
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.loading import build_decoder
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, random_prompts

PROBS = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])  # P(a), a = 0..7, measured with K=8


def test_expected_tokens_per_forward_by_hand():
    assert cal.expected_tokens_per_forward(PROBS, 2, 2) == pytest.approx(0.5 * 1 + 0.5 * 2)
    # K=4 sees min(a, 3): 0.5*1 + 0.2*2 + 0.1*3 + 0.2*4
    assert cal.expected_tokens_per_forward(PROBS, 4, 4) == pytest.approx(2.0)
    # K=4 with 2 groups serves a in {0, v}, v = real drafts (3 after a step served exactly).
    # With v = 3 a step commits 2.0 on average and a = 1, 2 (group 0, shifted) leave v = 2, 1;
    # with v = 2: a in {0, 1, >=2} w.p. .5/.2/.3 commits 1.8 and only a = 1 keeps v = 2; with
    # v = 1 it commits 1.5 and v returns to 3. Stationary shares 20/27, 5/27, 2/27 of v = 3, 2, 1.
    assert cal.expected_tokens_per_forward(PROBS, 4, 2) == pytest.approx((20 * 2.0 + 5 * 1.8 + 2 * 1.5) / 27)
    # one group (serving 0): a full acceptance commits 4 but leaves no real drafts, and the next
    # step commits 1 and restores them, so the chain alternates: 2.5 tokens per step
    assert cal.expected_tokens_per_forward(np.array([0, 0, 0, 1.0]), 4, 1) == pytest.approx(2.5)
    # half the time 2 accepted: 3 committed, 1 real draft left, then 1 accepted, 2 committed, 2
    # real drafts left, then 2 accepted again...: a row ends up alternating 3 and 2 tokens
    assert cal.expected_tokens_per_forward(np.array([0, 0, 0.5, 0.5]), 4, 1) == pytest.approx(2.5)
    # every group served: a row always has M fresh drafts, and the chain is the plain expectation
    assert cal.expected_tokens_per_forward(PROBS, 8, 8) == pytest.approx(float(PROBS @ (np.arange(8) + 1)))


def test_batch_model_slowest_row_sets_the_pace():
    # two requests: one commits 2 tokens per step, the other 4 (K=4, all groups)
    rows = np.array([[0, 1, 0, 0], [0, 0, 0, 1]], float)
    one = cal.expected_batch_tokens_per_forward(rows, 4, 4, 1)
    assert one == pytest.approx(1 / (0.5 * (1 / 2 + 1 / 4)))  # total tokens / total steps
    # batch of 2 (rows drawn with replacement): the slow row is in it with probability 3/4
    assert cal.expected_batch_tokens_per_forward(rows, 4, 4, 2) == pytest.approx(1 / (0.25 / 4 + 0.75 / 2))
    assert cal.expected_batch_tokens_per_forward(rows, 4, 4, 64) == pytest.approx(2.0, rel=1e-6)
    assert cal.expected_batch_tokens_per_forward(PROBS, 4, 2, 16) == pytest.approx(
        cal.expected_tokens_per_forward(PROBS, 4, 2))  # one profile row: no spread
    # a queue of many requests on 2 rows (continuous batching): rows stay busy, so the rate
    # approaches the batch-1 (harmonic) rate, far above the static batch's slowest-row rate
    queued = cal.expected_batch_tokens_per_forward(rows, 4, 4, 2, num_requests=64)
    assert cal.expected_batch_tokens_per_forward(rows, 4, 4, 2) < queued < one * 1.05
    assert queued == pytest.approx(one, rel=0.1)


def test_choose_layout():
    free = {cal.AR: 1.0} | {c: 1.0 for c in cal.DEFAULT_CANDIDATES}
    best = cal.choose_layout(PROBS, free, 1)
    assert (best.block_size, best.groups) == (8, 8)  # wide steps are free: the widest wins
    assert best.expected_speedup == pytest.approx(cal.expected_tokens_per_forward(PROBS, 8, 8))
    linear = {cal.AR: 1.0} | {(k, g): float(LosslessLayout.build(k, g).width) for k, g in cal.DEFAULT_CANDIDATES}
    assert cal.choose_layout(PROBS, linear, 16).block_size == 1  # every width loses: AR
    # K=2 at 1.5 tokens per forward against a 1.45x step is a 1.03x "win": inside the margin
    assert cal.choose_layout(PROBS, {cal.AR: 1.0, (2, 2): 1.45}, 1, candidates=[(2, 2)]).block_size == 1
    assert cal.choose_layout(PROBS, {cal.AR: 1.0, (2, 2): 1.2}, 1, candidates=[(2, 2)]).block_size == 2
    # a spread of requests: K=4 wins alone, but in a batch of 16 the slow request sets the pace
    rows = np.array([[0.5, 0.5, 0, 0], [0, 0, 0, 1.0]])
    cost = {cal.AR: 1.0, (2, 2): 1.3, (4, 4): 1.6}
    assert cal.choose_layout(rows, cost, 1, candidates=[(2, 2), (4, 4)]).block_size == 4
    assert cal.choose_layout(rows, cost, 16, candidates=[(2, 2), (4, 4)]).block_size == 2
    with pytest.raises(ValueError, match="AR step"):
        cal.choose_layout(PROBS, {(2, 2): 1.0}, 1)
    ranked = cal.rank_layouts(rows, cost, 1, candidates=[(2, 2), (4, 4), (8, 8)])
    assert [c.layout for c in ranked] == [(4, 4), (2, 2)]  # (8, 8) has no measured cost
    assert ranked[0].expected_speedup > ranked[1].expected_speedup


def test_trials_measure_real_decodes_against_ar():
    model = create_model(CFG, seed=3)
    dec = Decoder(model, [1], DecodeOptions("lossless", 4, lossless=LosslessRule(adaptive=True)))
    speedups = cal.trial_speedups(dec, random_prompts(), [(2, 2), (4, 2)], 2, 8, repeats=1)
    assert set(speedups) == {(2, 2), (4, 2)} and all(0 < v < 100 for v in speedups.values())
    logs = []
    table = cal.calibrate(dec, random_prompts(), [2], 8, candidates=[(2, 2), (4, 2)], log=logs.append, trials=1)
    assert len(table) == 1 and table[0][0] == 2
    trial_line = next(m for m in logs if "trials" in m)
    assert "K=2,G=2" in trial_line  # the narrowest layout is always tried
    assert "measured" in logs[-1] or logs[-1].startswith("calibrate: batch 2: AR")


def test_acceptance_profile_predicts_narrower_layouts():
    """MARS drafts are causal: the K=8 profile predicts what K=2 and K=4 really commit."""
    tok = load_tokenizer(assets.DEMO_PROPOSER)
    prompts = [tok.encode(p["prompt"])[-96:] for p in heldout_prompts(build_corpus().heldout, limit=8)]
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"))
    rows = cal.acceptance_profile(dec, prompts, 64, 8)
    assert rows.shape == (8, 8) and np.allclose(rows.sum(axis=1), 1.0) and rows[:, 1:].sum(axis=1).mean() > 0.2
    for k, g in ((2, 2), (4, 2), (4, 4)):
        res = dec.with_options(DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=g))).generate(prompts, 64)
        measured = sum(map(len, res.output_ids)) / res.forwards.sum()
        predicted = cal.expected_batch_tokens_per_forward(rows, k, g, 1)
        assert predicted == pytest.approx(measured, rel=0.12), (k, g)
        # a batch of all 8 runs until its slowest row is done: per-row tokens per batch step
        in_batch = np.mean([len(o) for o in res.output_ids]) / res.forwards.max()
        in_batch_predicted = cal.expected_batch_tokens_per_forward(rows, k, g, 8)
        assert in_batch_predicted <= predicted and in_batch <= measured
        assert in_batch_predicted == pytest.approx(in_batch, rel=0.12), (k, g)


def test_decoder_follows_its_table_and_stays_lossless():
    model = create_model(CFG, seed=3)
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts(), 16)
    dec = Decoder(model, [1], DecodeOptions("lossless", 8, lossless=LosslessRule(adaptive=True)), adaptive_table=((1, 2, 2), (4, 1, 1)))
    one = dec.generate(random_prompts()[:1], 16)
    assert (one.options.mode, one.options.block_size, one.options.lossless.max_groups) == ("lossless", 2, 2)
    assert one.output_ids == ar.output_ids[:1]
    four = dec.generate(random_prompts(), 16)
    assert four.options.mode == "ar" and four.output_ids == ar.output_ids  # K=1 row: plain AR
    past = dec.generate(random_prompts() * 2, 16)
    assert past.options.mode == "ar"  # past the last row: AR
    for bad in (((1, 2, 2), (1, 4, 4)), ((0, 2, 2),), ((1, 2),)):
        with pytest.raises(DecodeError, match="adaptive table"):
            check_adaptive_table(bad)


def test_time_step_widths_is_positive():
    costs = step_timing.time_step_widths(create_model(CFG, seed=0), 2, (1, 64), slots=128, filled=32, repeats=2, steps=4)
    assert set(costs) == {1, 64} and all(v > 0 for v in costs.values())


def test_time_decode_steps_times_the_engine_step_of_each_layout(monkeypatch):
    from prove_jax.decoding import program
    traced = []
    real = program.decode_step

    def spy(options, *a, **kw):
        traced.append((options.mode, options.block_size, options.lossless.max_groups))
        return real(options, *a, **kw)
    monkeypatch.setattr(program, "decode_step", spy)
    costs = step_timing.time_decode_steps(create_model(CFG, seed=0), 2, [(2, 2), (4, 2)], slots=128, filled=32,
                                  repeats=2, steps=4)
    assert set(costs) == {cal.AR, (2, 2), (4, 2)} and all(v > 0 for v in costs.values())
    assert set(traced) == {("ar", 1, None), ("lossless", 2, 2), ("lossless", 4, 2)}


def test_time_decode_steps_sizes_its_timings_and_drops_what_keep_rejects(monkeypatch):
    counts = []  # (step count of a call), in call order
    real = step_timing.timed

    def spy(fn, params, state, n):
        counts.append(int(n))
        return real(fn, params, state, n)
    monkeypatch.setattr(step_timing, "timed", spy)
    asked = []

    def keep(cost):
        asked.append(dict(cost))
        return {cal.AR}  # drop both lossless layouts after the first round
    costs = step_timing.time_decode_steps(create_model(CFG, seed=0), 2, [(2, 2), (4, 2)], slots=128, filled=32,
                                  repeats=3, steps=6, seconds_per_timing=1e-9, keep=keep)
    assert set(costs) == {cal.AR, (2, 2), (4, 2)} and all(v > 0 for v in costs.values())
    # per layout: compile run and probe (1 step each); then, a tiny time budget: 1-step timings
    assert counts[:6] == [1] * 6 and counts[6:] == [1, 1, 1, 1, 1]  # round 1: all; rounds 2-3: AR only
    assert len(asked) == 1 and set(asked[0]) == set(costs)
    counts.clear()
    step_timing.time_decode_steps(create_model(CFG, seed=0), 2, [(2, 2)], slots=128, filled=32, repeats=1,
                          steps=6, seconds_per_timing=1e9)
    assert counts == [1, 1, 1, 1, 6, 6]  # a generous budget: capped at `steps`


def test_promising_layouts_drops_layouts_that_cannot_pay():
    probs = np.array([[0.1, 0.1, 0.1, 0.7]])  # P(a) for a = 0..3: mostly every draft accepted
    keep = cal.PromisingLayouts(probs, 1, [(2, 2), (4, 2)])
    kept = keep({cal.AR: 1.0, (2, 2): 1.2, (4, 2): 40.0})  # (4, 2) costs 40 AR steps
    assert kept == {cal.AR, (2, 2)} and keep.dropped == [(4, 2)]
    speedups = cal.expected_speedups(probs, {cal.AR: 1.0, (2, 2): 1.2, (4, 2): 40.0}, 1, [(2, 2), (4, 2)])
    assert speedups[(2, 2)] > cal.PRUNE_BELOW > speedups[(4, 2)]


@pytest.mark.slow
def test_cli_calibrate(tmp_path, capsys):
    """`infer.generate --calibrate`, the command's main in this process."""
    model = create_model(CFG, seed=3)
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(random_prompts())))
    out = tmp_path / "out.jsonl"
    code = generate.main(["--model", ckpt, "--mode", "lossless", "--calibrate", "--block-size", "3", "--input",
                          str(inp), "--output", str(out), "--max-new-tokens", "12", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    # the suite's 8 simulated devices, all on the data axis: the 2 rows asked for decode as 8,
    # and calibration measures the size that runs
    assert "calibrate: acceptance with K=3" in err and "calibrate: batch 8:" in err
    ar = Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts(), 12)
    assert [json.loads(x)["output_ids"] for x in out.read_text().splitlines()] == ar.output_ids
    code = generate.main(["--model", ckpt, "--mode", "ar", "--calibrate", "--input", str(inp),
                          "--output", str(tmp_path / "x.jsonl")])
    assert code == 2 and "--calibrate chooses lossless layouts" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_benchmark_calibrated_setting(tmp_path):
    from prove_jax.evaluation.benchmark import run_settings
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.report import markdown_table
    from prove_jax.evaluation.sweep import ar_setting, calibrated_setting
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, create_model(CFG, seed=3))
    pair = load_pair(ckpt)
    settings = [ar_setting(), calibrated_setting(3)]
    assert settings[1].label == "calibrated,K<=3" and settings[1].options.lossless.adaptive
    records, _ = run_settings(pair, settings, random_prompts(), 12, [2], repeats=1, progress=lambda m: None)
    ar, calibrated = records
    assert calibrated["agreement_with_ar"] == 1.0 and calibrated["generated_tokens"] == ar["generated_tokens"]
    eff = calibrated["effective_options"]  # what calibration chose for batch 2 is on record
    assert eff["mode"] == "ar" or (eff["mode"] == "lossless" and 2 <= eff["block_size"] <= 3)
    assert "| lossless | calibrated,K<=3 (" in markdown_table(records)


def test_benchmark_sweep_adaptive_as_the_cli_and_calibrated_optional():
    """The benchmark's adaptive setting caps K at 8, as `infer.generate --adaptive` does (K=4
    capped the GPU/TPU table's K=8 rows); `calibrated=False` (`--no-calibrated`) leaves out the
    calibrated setting, whose measurements compile every candidate layout."""
    from prove_jax.evaluation.sweep import sweep_settings
    from prove_jax.cli.generate import decode_options, parse_args
    cli_k = decode_options(parse_args(["--mode", "lossless", "--adaptive", "--input", "i", "--output", "o"])).block_size
    by_label = {s.label: s for s in sweep_settings(["lossless"], False, lossless=[])}
    assert list(by_label)[1:] == [f"adaptive,K<={cli_k}", f"calibrated,K<={cli_k}"] and cli_k == 8
    assert by_label[f"adaptive,K<={cli_k}"].options.block_size == 8
    assert not by_label[f"adaptive,K<={cli_k}"].calibrate
    labels = [s.label for s in sweep_settings(["lossless"], False, lossless=[], calibrated=False)]
    assert labels[1:] == ["adaptive,K<=8"]


def test_fastest_interleaved_warms_up_interleaves_and_keeps_the_fastest():
    calls = []
    times = {"a": iter([9.0, 3.0, 5.0]), "b": iter([9.0, 4.0, 2.0])}  # warm-up, round 1, round 2

    def timed(key):
        def run():
            calls.append(key)
            return next(times[key])
        return run

    best = timing.fastest_interleaved({"a": timed("a"), "b": timed("b")}, repeats=2)
    assert best == {"a": 3.0, "b": 2.0}  # the warm-up never counts
    assert calls == ["a", "b", "a", "b", "a", "b"]  # rounds alternate, so load hits both alike
    with pytest.raises(ValueError, match="repeats must be >= 1"):  # zero rounds timed nothing: inf
        timing.fastest_interleaved({"a": timed("a")}, repeats=0)
    calls.clear()
    times.update(a=iter([3.0, 2.0]), b=iter([4.0]))
    best = timing.fastest_interleaved({"a": timed("a"), "b": timed("b")}, repeats=2, warm_up=False,
                                   keep=lambda best: [k for k, v in best.items() if v < 3.5])
    assert calls == ["a", "b", "a"] and best == {"a": 2.0, "b": 4.0}  # b, dropped, keeps its one timing


def test_calibrate_decoder_measures_the_rows_generate_decodes_within_the_group_cap(monkeypatch):
    """On a 2-way data axis a batch of 1 decodes 2 rows: the table must be measured and keyed
    there, or `generate` never finds it and silently runs AR. The --groups cap bounds the
    layouts it may choose, and a batch size below 1 is an error, not a trace-time crash."""
    from prove_jax.models.sharding import make_mesh
    from tests.decode_helpers import load_or_shard
    seen = {}

    def fake_calibrate(decoder, prompts, batch_sizes, max_new_tokens, candidates, log=None, num_requests=None):
        seen.update(batch_sizes=list(batch_sizes), candidates=list(candidates))
        return tuple((b, 2, 2) for b in batch_sizes)
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    mesh = make_mesh((2, 1, 1), devices=__import__("jax").devices()[:2])
    model = create_model(CFG, seed=3)
    dec = Decoder(load_or_shard(model, mesh), [1], DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2, adaptive=True)),
                  mesh=mesh)
    cal.calibrate_decoder(dec, random_prompts(), 1, 16)
    assert seen["batch_sizes"] == [2]
    assert seen["candidates"] == [(k, g) for k, g in cal.DEFAULT_CANDIDATES if g <= 2]
    res = dec.generate(random_prompts()[:1], 12, batch_size=1)
    assert (res.options.mode, res.options.block_size) == ("lossless", 2)
    assert res.output_ids == Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts()[:1], 12).output_ids
    with pytest.raises(DecodeError, match="batch size must be >= 1, got 0"):
        cal.calibrate_decoder(dec, random_prompts(), 0, 16)
    capped = Decoder(model, [1], DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=1, adaptive=True)))
    with pytest.raises(DecodeError, match="no lossless layout to calibrate"):
        cal.calibrate_decoder(capped, random_prompts(), 1, 16)


def test_rows_are_capped_at_the_requests():
    """A batch larger than the queue decodes only rows that have a request, so the adaptive
    layout is the one for the real batch (this table: lossless up to 4 rows, AR past it)."""
    model = create_model(CFG, seed=3)
    dec = Decoder(model, [1], DecodeOptions("lossless", 8, lossless=LosslessRule(adaptive=True)), adaptive_table=((4, 4, 2),))
    res = dec.generate(random_prompts()[:3], 12, batch_size=32)
    assert (res.options.mode, res.options.block_size) == ("lossless", 4)
    assert res.output_ids == Decoder(model, [1], DecodeOptions("ar")).generate(random_prompts()[:3], 12).output_ids
    assert dec.rows(32, 3) == 3 and dec.rows(2, 9) == 2
