"""The demo and the benchmark, end to end on a tiny proposer/verifier pair made here.

Oracles: our own `ar` (lossless must agree 100%), transformers greedy `generate` on the HF copy
of the same weights (must agree 100% at batch 1), the tokenizer's own decode (the committed
blocks of the demo must spell the completion), the per-step trace against the engine's counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re

import pytest

from prove_jax.cli import benchmark, demo
from prove_jax.cli.bench_args import arg_type, parse_choices, parse_layouts, positive_ints
from prove_jax.evaluation.benchmark import long_prompts
from prove_jax.evaluation.compare import agreement, completion_text, our_sequence, peer_sequence
from prove_jax.evaluation.model_pair import load_pair
from prove_jax.evaluation.records import add_decode_only, add_vs_lossless, make_record
from prove_jax.evaluation.report import accuracy_cell, lossless_note, markdown_table
from prove_jax.evaluation.runners import Measurement
from prove_jax.evaluation.sweep import (ALL_MODES, BenchError, DEFAULT_LOSSLESS, ar_setting,
                                        calibrated_setting, lossless_setting, sweep_settings)
from prove_jax.evaluation import benchmark as bench_lib
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.models.config import ModelConfig
from prove_jax.decoding import DecodeOptions, ThresholdRule
from prove_jax.models.params import create_model
from prove_jax.profiling import trace_files
from tests import prewarmed
from tests.tokenizers_fixture import make_tokenizer

REQUIRED = ("mode", "setting", "batch_size", "tokens_per_forward", "tokens_per_second",
            "speedup_vs_ar", "speedup_fastest_vs_ar", "agreement_with_ar", "exact_match_with_ar", "pass_at_1",
            "ar_match_hist", "compile_seconds", "generated_tokens", "proposer_forwards")


def _cfg(vocab: int, layers: int, hidden: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                       eos_token_ids=(0,), pad_token_id=0, mask_token_id=vocab - 1,
                       max_position_embeddings=1024)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(proposer dir, verifier dir): random tiny Qwen2 models on a real stdlib BPE + <|mask|>."""
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer(300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]})
    vocab = len(tok)
    assert tok.convert_tokens_to_ids("<|mask|>") == vocab - 1
    tok.save_pretrained(str(root / "tok"))
    paths = []
    for name, layers, hidden, seed in (("proposer", 2, 32, 1), ("verifier", 1, 32, 2)):
        save_model(str(root / name), create_model(_cfg(vocab, layers, hidden), seed=seed),
                   tokenizer_dir=str(root / "tok"))
        paths.append(str(root / name))
    return tuple(paths)


def test_record_steps_trace_matches_counters_and_changes_nothing(pair):
    loaded = load_pair(pair[0])
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    for opts in (DecodeOptions("lossless", 3), DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.0))):
        plain = loaded.decoder(opts).generate(prompts, 12)
        traced = loaded.decoder(dataclasses.replace(opts, record_steps=True)).generate(prompts, 12)
        assert plain.step_commits is None
        assert traced.output_ids == plain.output_ids
        for out, steps, fwd in zip(traced.output_ids, traced.step_commits, traced.forwards):
            assert len(steps) == fwd and sum(steps) == len(out) and min(steps) >= 1
        if opts.mode == "threshold":  # tau 0 accepts the whole block: K tokens per step
            assert all(s[:-1] == [4] * (len(s) - 1) for s in traced.step_commits)


def test_head_thresholds_sweep_the_commit_head_beside_its_own():
    settings = [s for s in sweep_settings(["verify"], True, 6, head_thresholds=[0.3, 0.1])
                if s.options.verify.commit_rule == "head"]
    assert [s.options.verify.head_threshold for s in settings] == [None, 0.3, 0.1]
    assert [s.label for s in settings] == ["K=6,head", "K=6,head,p>=0.3", "K=6,head,p>=0.1"]
    assert not [s for s in sweep_settings(["verify"], False, head_thresholds=[0.3])
                if s.options.verify.commit_rule == "head"]


def test_gate_taus_add_the_gated_verifier_rules():
    settings = [s for s in sweep_settings(["verify"], False, 6, tau_vs=[0.3], gate_taus=[0.8, 0.6])
                if s.options.verify.gate_tau is not None]
    assert [(s.options.verify.commit_rule, s.options.verify.tau_v, s.options.verify.gate_tau) for s in settings] == [
        ("top1", 0.5, 0.8), ("top1", 0.5, 0.6), ("prob", 0.3, 0.8), ("prob", 0.3, 0.6)]
    assert [s.label for s in settings][-1] == "K=6,prob,tau_v=0.3,gate=0.6"
    assert {s.options.threshold.confidence for s in settings} == {"prob"}
    # --confidence picks the gate's statistic, as generate's does
    margin = [s for s in sweep_settings(["verify"], False, 6, tau_vs=[0.3], gate_taus=[0.4],
                                        confidence="margin") if s.options.verify.gate_tau is not None]
    assert [s.options.threshold.confidence for s in margin] == ["margin", "margin"]
    assert [s.label for s in margin] == ["K=6,top1,margin gate=0.4", "K=6,prob,tau_v=0.3,margin gate=0.4"]


def test_rules_pick_the_verify_settings():
    settings = sweep_settings(["verify"], True, 8, tau_vs=[0.3], gate_taus=[0.6], rules=["prob"])
    assert [s.label for s in settings] == ["-", "K=8,prob,tau_v=0.3", "K=8,prob,tau_v=0.3,gate=0.6"]
    both = sweep_settings(["verify"], True, 8, tau_vs=[0.3], gate_taus=[0.6], rules=["top1", "head"])
    assert [s.label for s in both] == ["-", "K=8,top1", "K=8,top1,gate=0.6", "K=8,head"]
    # the default runs every rule, head only where the verifier has one
    assert {s.options.verify.commit_rule for s in sweep_settings(["verify"], False)[1:]} == {"top1", "prob"}


def test_limit_takes_the_first_records_of_a_prompts_file():
    from prove_jax import assets
    path = os.path.join(os.path.dirname(assets.ARITH_PROPOSER), "arith_test.jsonl")
    records, desc = benchmark.load_prompt_records(benchmark.parse_args(["--prompts", path, "--limit", "16"]))
    with open(path) as f:
        first = [json.loads(line)["id"] for line in f][:16]
    assert [r["id"] for r in records] == first and desc.startswith("the first 16 records of ")
    for argv, message in [(["--limit", "4"], "give a file"), (["--prompts", path, "--limit", "0"], ">= 1, got 0")]:
        with pytest.raises(BenchError, match=message):
            benchmark.load_prompt_records(benchmark.parse_args(argv))


def test_agreement_and_output_forms():
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == {
        "agreement_with_ar": 1.0, "exact_match_with_ar": 1.0}
    # row 1: 2 of 3 positions; row 2: 1 of max(1, 3) = 3 positions -> 3 / 6
    assert agreement([[1, 9, 3], [4]], [[1, 2, 3], [4, 5, 6]]) == {
        "agreement_with_ar": 0.5, "exact_match_with_ar": 0.0}
    assert our_sequence([3, 7, 2, 9], eos_ids=[0, 7]) == [3, 0]
    assert peer_sequence([3, 4], max_new_tokens=5, eos_ids=[0]) == [3, 4, 0]
    assert peer_sequence([3, 4], max_new_tokens=2, eos_ids=[0]) == [3, 4]


def test_layouts_parse_and_bad_values_name_the_flag():
    assert parse_layouts("6x2, 4X2,3") == ((6, 2), (4, 2), (3, None))
    assert parse_layouts("") == ()
    for bad, message in [("1", "--layouts: '1': K must be >= 2"), ("6x0", "--layouts: '6x0': K must be >= 2 and G >= 1"),
                         ("6by2", "--layouts: '6by2' is not a layout; write K x G as 6x2"),
                         ("6x2x1", "--layouts: '6x2x1' is not a layout")]:
        with pytest.raises(BenchError) as e:
            parse_layouts(bad)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(BenchError, match="^--lossless-blocks: '4y'"):
        parse_layouts("4y", "--lossless-blocks")
    assert parse_choices("ar, lossless", ALL_MODES, "--modes") == ["ar", "lossless"]
    with pytest.raises(BenchError, match="^--modes: unknown 'fast'; choose from ar, threshold"):
        parse_choices("ar,fast", ALL_MODES, "--modes")
    # the default sweep, and the old spelling still read
    assert benchmark.layouts_arg(benchmark.parse_args([])) == ("--layouts", DEFAULT_LOSSLESS)
    assert benchmark.layouts_arg(benchmark.parse_args(["--layouts", "6x2,4x2"])) == ("--layouts", ((6, 2), (4, 2)))
    assert benchmark.layouts_arg(benchmark.parse_args(["--lossless-blocks", "6x2"])) == ("--lossless-blocks", ((6, 2),))


def _demo(pair, capsys, *argv):
    rc = demo.main(["--model", pair[0], "--verifier", pair[1], "--inflate", "none", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def _rows(lines: list[str], header: str, n: int) -> list[list[str]]:
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "setting"] and header in line)
    return [line.split() for line in lines[head + 1: head + 1 + n]]


def test_demo_says_tokens_per_forward_and_that_lossless_is_ar(pair, capsys):
    """The recommended defaults (K=6, G=2 on CPU), at the model's own size: tiny and fast."""
    out, err = _demo(pair, capsys, "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1")
    assert "compile + warm-up: lossless K=6,G=2" in err  # progress while compiling
    lines = out.splitlines()
    assert "1. On any machine: tokens per proposer forward, and exactness" in lines
    rows = _rows(lines, "tokens/forward", 2)
    assert [r[:3] for r in rows] == [["ar", "-", "1.00"], ["lossless", "K=6,G=2", rows[1][2]]]
    assert float(rows[1][2]) >= 1.0
    assert " ".join(rows[1][3:]) == "yes, token for token (1 of 1 prompts, 8 tokens, checked)"
    speed = _rows(lines, "tok/s", 2)
    assert [r[:2] for r in speed] == [["ar", "-"], ["lossless", "K=6,G=2"]] and speed[0][3] == "1.00x"
    assert "the proposer at its own size" in out
    assert re.search(r"Verdict: .* with the same output token for token\. Why: it ran", " ".join(out.split()))
    assert "[" in lines[-1]  # not a TTY: brackets per committed block


def test_demo_layout_flags_and_lossy_modes(pair, capsys):
    out, _ = _demo(pair, capsys, "--num-prompts", "2", "--max-new-tokens", "10", "--block-size", "3",
                   "--groups", "2", "--repeats", "1", "--lossy", "--tau", "0.5", "--show", "1")
    lines = out.splitlines()
    rows = _rows(lines, "tokens/forward", 4)
    assert [r[:2] for r in rows] == [["ar", "-"], ["lossless", "K=3,G=2"], ["threshold", "K=3,tau=0.5"],
                                     ["verify", "K=3,top1"]]  # this verifier has no commit head
    assert rows[1][3:6] == ["yes,", "token", "for"] and rows[2][-1] == rows[3][-1] == "(lossy)"
    assert [r[:2] for r in _rows(lines, "tok/s", 4)] == [r[:2] for r in rows]
    assert any(line.startswith("3. HumanEval/1, lossless K=3,G=2:") for line in lines)


def test_demo_exactness_and_verdict_in_words():
    ar = Measurement(ar_setting(), 1, outputs=[[1, 2, 3, 4], [5, 6]],
                     proposer_forwards=6, seconds=[6.0, 7.0])
    ll = Measurement(lossless_setting(6, 2), 1, outputs=[[1, 2, 3, 4], [5, 6]],
                     proposer_forwards=2, seconds=[3.0, 2.5])
    assert demo.exactness_line([ar, ll]) == "yes, token for token (2 of 2 prompts, 6 tokens, checked)"
    head, why = demo.verdict([ar, ll], exact=True)
    assert head == ("Verdict: ProVe-lossless decoded 2.4x as fast as greedy AR here, with the same "
                    "output token for token.")
    # fastest passes: 2.5 s / 2 forwards against 6 s / 6 forwards
    assert why.startswith("Why: it ran 3.0x fewer forwards, and one 16-token forward cost about 1.2 "
                          "one-token AR forwards") and why.endswith("so the fewer forwards won.")
    ll.seconds = [6.2]
    assert "no real speedup here (0.97x AR" in demo.verdict([ar, ll], exact=True)[0]
    ll.seconds, ll.outputs = [9.0], [[1, 2, 3, 4], [5, 7]]
    head, why = demo.verdict([ar, ll], exact=False)
    assert "was slower than greedy AR here (0.67x), but its output was not AR's" in head
    assert why.endswith("so the fewer forwards did not pay.")
    assert demo.exactness_line([ar, ll]) == "NO: 1 of 2 prompts equal; prompt 1 differs from token 1 on"
    assert demo.recommended_layout("cpu") == (6, 2) and demo.recommended_layout("gpu") == (8, 8)


def test_demo_blocks_spell_the_completion(pair):
    loaded = load_pair(pair[0])
    res = loaded.decoder(DecodeOptions("lossless", 3, record_steps=True)).generate([[40, 41, 42]], 16)
    ids, steps = res.output_ids[0], res.step_commits[0]
    texts = demo.block_texts(loaded.tokenizer, ids, steps)
    assert len(texts) == len(steps)
    assert "".join(texts) == loaded.tokenizer.decode(ids, skip_special_tokens=False)
    assert demo.render_blocks(texts, colour=False) == "".join(f"[{t}]" for t in texts)
    coloured = demo.render_blocks(texts, colour=True)
    assert coloured.count(demo.RESET) == len(texts) and demo.COLOURS[0] in coloured


def test_benchmark_tiny_run_writes_wellformed_json(pair, tmp_path):
    out = tmp_path / "bench"
    rc = benchmark.main(["--model", pair[0], "--verifier", pair[1], "--humaneval", "2",
                         "--max-new-tokens", "8", "--batch-sizes", "1,2", "--repeats", "2",
                         "--modes", "ar,lossless,hf_greedy", "--layouts", "3",
                         "--no-adaptive", "--torch-threads", "1", "--prefill-baseline",
                         "--json", f"{out}.json", "--md", f"{out}.md", "--png", f"{out}.png"])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["num_prompts"] == 2 and doc["meta"]["torch_threads"] == [1]
    # no mode here ran the verifier (nor hf_assisted's draft): the report does not name it
    assert doc["meta"]["verifier"] is None and "verifier `" not in (tmp_path / "bench.md").read_text()
    recs = doc["records"]
    assert [(r["mode"], r["batch_size"]) for r in recs] == [
        ("ar", 1), ("lossless", 1), ("hf_greedy", 1), ("ar", 2), ("lossless", 2), ("hf_greedy", 2)]
    for r in recs:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["tokens_per_forward"] == pytest.approx(r["generated_tokens"] / r["proposer_forwards"])
        assert r["tokens_per_second"] == pytest.approx(r["generated_tokens"] / r["seconds_median"])
        assert len(r["seconds_all"]) == 2 and 0.0 <= r["pass_at_1"] <= 1.0
        assert r["humaneval_problems"] == 2
        # HumanEval prompts carry their reference: graded by the harness without an answer given
        assert r["graded_by"] == {"humaneval": 2} and r["accuracy"] == r["pass_at_1"]
        assert 2 <= r["generated_tokens"] <= 2 * 8
    by = {(r["mode"], r["batch_size"]): r for r in recs}
    for b in (1, 2):
        ar, ll = by[("ar", b)], by[("lossless", b)]
        assert ar["speedup_vs_ar"] == 1.0 and ar["tokens_per_forward"] == 1.0
        assert ll["agreement_with_ar"] == 1.0 and ll["exact_match_with_ar"] == 1.0
        assert ll["generated_tokens"] == ar["generated_tokens"]
        assert ll["pass_at_1"] == ar["pass_at_1"]
        assert sum(ll["ar_match_hist"]) == ll["proposer_forwards"] and len(ll["ar_match_hist"]) == 4
        assert ll["speedup_vs_ar"] == pytest.approx(ll["tokens_per_second"] / ar["tokens_per_second"])
        assert ar["speedup_fastest_vs_ar"] == 1.0
        assert ll["speedup_fastest_vs_ar"] == pytest.approx(
            ll["generated_tokens"] / min(ll["seconds_all"]) / (ar["generated_tokens"] / min(ar["seconds_all"])))
        assert ll["compile_seconds"] > 0
        # the prefill baseline: timed and taken out of both sides (8 new tokens of a tiny model
        # cost about what the prefill does, so only the arithmetic is checked here)
        p = ar["prefill_seconds"]
        assert p > 0 and ll["prefill_seconds"] == p
        if ar["seconds_median"] > p and ll["seconds_median"] > p:
            assert ar["decode_speedup_vs_ar"] == pytest.approx(1.0)
            assert ll["decode_speedup_vs_ar"] == pytest.approx(
                (ar["seconds_median"] - p) / (ll["seconds_median"] - p))
        assert by[("hf_greedy", b)]["decode_speedup_vs_ar"] is None
    # transformers greedy on the HF copy of the same weights is the outside AR oracle
    assert by[("hf_greedy", 1)]["agreement_with_ar"] == 1.0
    assert by[("hf_greedy", 1)]["setting"] == "threads=1"
    md = (tmp_path / "bench.md").read_text()
    assert "side by side in one run" in md and md.count("\n| lossless | K=3,G=3 |") == 2
    assert "| speedup without prefill |" in md and "Prefill baseline" in md
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the records-so-far files are gone once the report is whole
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "bench.md", "bench.png"]


def test_benchmark_grades_prompts_with_answers_and_lossless_scores_as_ar(pair, tmp_path):
    """A prompts file with answers: each mode's accuracy over the graded prompts, with its
    interval; lossless decodes AR's very tokens, so its accuracy is AR's exactly."""
    from prove_jax.evaluation import graders, plot
    loaded = load_pair(pair[0])
    tok, eos = loaded.tokenizer, loaded.eos_ids
    texts = ["def add(a, b):\n", "import os\n", "x = 1\n", "class A:\n"]
    ar = loaded.decoder(DecodeOptions("ar", block_size=1)).generate(
        [tok.encode(t, add_special_tokens=False) for t in texts], 8)
    said = [completion_text(tok, our_sequence(o, eos), eos) for o in ar.output_ids]
    records = [{"id": "right", "prompt": texts[0], "answer": said[0]},  # graded by --grader exact
               {"id": "wrong", "prompt": texts[1], "answer": said[1] + " and more"},
               {"id": "number", "prompt": texts[2], "answer": "#### 7", "grader": "last_number"},
               {"id": "free", "prompt": texts[3]}]  # no answer: not graded
    ar_right = 1 + (graders.last_number(said[2]) == 7)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "bench"
    rc = benchmark.main(["--model", pair[0], "--prompts", str(tmp_path / "p.jsonl"), "--grader", "exact",
                         "--max-new-tokens", "8", "--batch-sizes", "1", "--repeats", "1",
                         "--modes", "ar,lossless,threshold", "--taus", "0", "--layouts", "3",
                         "--no-adaptive", "--no-peers", "--json", f"{out}.json", "--md", f"{out}.md",
                         "--png", f"{out}.png", "--tensorboard", str(tmp_path / "tb"),
                         "--profile", str(tmp_path / "trace")])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["graded"] == {"exact": 2, "last_number": 1}
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    (trace,) = trace_files(str(tmp_path / "trace"))  # --profile: the timed passes, named
    assert b"benchmark_pass" in open(trace, "rb").read()
    by = {r["mode"]: r for r in doc["records"]}
    ar_rec, ll, th = by["ar"], by["lossless"], by["threshold"]
    assert (ar_rec["correct"], ar_rec["graded"]) == (ar_right, 3)
    assert ar_rec["accuracy"] == pytest.approx(ar_right / 3)
    assert ar_rec["accuracy_ci95"] == pytest.approx(list(graders.wilson_interval(ar_right, 3)))
    assert ll["exact_match_with_ar"] == 1.0
    for key in ("accuracy", "accuracy_ci95", "correct", "graded", "graded_by"):
        assert ll[key] == ar_rec[key], key
    assert ll["accuracy_vs_ar"] == {"gained": 0, "lost": 0} and ll["pass_at_1"] is None
    gained, lost = th["accuracy_vs_ar"]["gained"], th["accuracy_vs_ar"]["lost"]
    assert th["graded"] == 3 and th["correct"] == ar_right + gained - lost
    md = (tmp_path / "bench.md").read_text()
    assert "| accuracy [95% CI] |" in md and "Accuracy: 3 of 4 prompts graded, 2 by `exact`: " in md
    assert all(f"| {accuracy_cell(r)} |" in md for r in doc["records"])
    panels = len(plot.figure_panels(doc["records"]))  # 1 where every mode scored the same
    png = (tmp_path / "bench.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 780 * panels


def test_benchmark_stopped_midway_keeps_finished_batch_sizes_beside_the_report(pair, tmp_path,
                                                                               monkeypatch, capsys):
    out = tmp_path / "bench"
    (tmp_path / "bench.json").write_text("an earlier finished report\n")
    measure = bench_lib.measure_batch
    calls = []

    def measure_then_fail(runners, *a, **k):  # batch size 2 fails (e.g. out of memory)
        calls.append(len(runners))
        if len(calls) == 2:
            raise BenchError("stopped at batch 2")
        return measure(runners, *a, **k)

    monkeypatch.setattr(bench_lib, "measure_batch", measure_then_fail)
    rc = benchmark.main(["--model", pair[0], "--verifier", pair[1], "--humaneval", "2",
                         "--max-new-tokens", "4", "--batch-sizes", "1,2", "--repeats", "1",
                         "--modes", "ar,lossless", "--lossless-blocks", "3", "--no-adaptive",
                         "--no-peers", "--json", f"{out}.json", "--md", f"{out}.md", "--png", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: stopped at batch 2" in err and "bench.json.partial" in err
    assert (tmp_path / "bench.json").read_text() == "an earlier finished report\n"  # not overwritten
    assert not (tmp_path / "bench.md").exists()
    doc = json.loads((tmp_path / "bench.json.partial").read_text())
    assert doc["meta"]["partial"] == {"batch_sizes_done": [1], "batch_sizes": [1, 2]}
    assert [(r["mode"], r["batch_size"]) for r in doc["records"]] == [("ar", 1), ("lossless", 1)]
    assert doc["records"][1]["agreement_with_ar"] == 1.0 and doc["records"][1]["pass_at_1"] is None
    md = (tmp_path / "bench.md.partial").read_text()
    assert "**Partial results**: batch sizes 1 of 1, 2" in md and md.count("\n| lossless | K=3,G=3 | 1 |") == 1


def test_lossy_rows_are_compared_with_the_fastest_lossless_setting_round_by_round():
    def rec(mode, setting, tokens, seconds, peer=False):
        ordered = sorted(seconds)
        return {"mode": mode, "setting": setting, "batch_size": 1, "peer": peer, "generated_tokens": tokens,
                "seconds_all": seconds, "tokens_per_second": tokens / ordered[len(ordered) // 2]}
    recs = [rec("ar", "-", 100, [20.0, 21.0, 22.0]),
            rec("lossless", "K=6,G=2", 100, [10.0, 13.0, 11.0]),  # median 11: 9.09 tok/s
            rec("lossless", "K=5,G=2", 100, [12.0, 10.5, 10.5]),  # median 10.5: the fastest
            rec("verify", "K=8,top1", 100, [9.0, 10.0, 10.0]),
            rec("relaxed", "K=6,G=2,p=0.3", 100, [11.0, 11.0, 12.0]),
            rec("hf_greedy", "threads=1", 100, [5.0, 5.0, 5.0], peer=True)]
    add_vs_lossless(recs)
    verify, relaxed = recs[3], recs[4]
    assert verify["fastest_lossless"] == relaxed["fastest_lossless"] == "K=5,G=2"
    assert verify["vs_lossless"] == pytest.approx(10.5 / 10.0)
    # each round against that round's faster lossless pass: 10.0, 10.5, 10.5 seconds
    assert verify["vs_lossless_rounds"] == pytest.approx([10.0 / 9.0, 10.5 / 10.0, 10.5 / 10.0])
    assert relaxed["vs_lossless"] == pytest.approx(10.5 / 11.0)
    assert all("vs_lossless" not in r for r in recs[:3] + recs[5:])  # ar, lossless and peers: none
    note = lossless_note(recs)
    assert "- batch 1, verify K=8,top1: 1.05x lossless K=5,G=2 (by round: 1.11x, 1.05x, 1.05x)" in note
    no_lossless = [dict(r) for r in recs if r["mode"] != "lossless"]
    for r in no_lossless:
        r.pop("vs_lossless", None)
    add_vs_lossless(no_lossless)
    assert lossless_note(no_lossless) == ""


def test_decode_only_speedup_takes_the_prefill_out_of_both_sides():
    recs = [{"peer": False, "generated_tokens": 100, "seconds_median": 12.0},  # ar
            {"peer": False, "generated_tokens": 100, "seconds_median": 7.0},
            {"peer": False, "generated_tokens": 90, "seconds_median": 5.0},
            {"peer": True, "generated_tokens": 100, "seconds_median": 30.0}]
    add_decode_only(recs, 2.0)
    assert [r["decode_speedup_vs_ar"] for r in recs[:3]] == pytest.approx([1.0, 2.0, 0.9 * 10 / 3])
    assert recs[3]["decode_speedup_vs_ar"] is None
    assert [r["prefill_seconds"] for r in recs] == [2.0, 2.0, 2.0, None]
    assert "speedup without prefill" not in markdown_table([])
    for r, mode in zip(recs, ("ar", "lossless", "lossless", "hf_greedy")):
        r.update(mode=mode, setting="-", batch_size=1, tokens_per_forward=1.0, tokens_per_second=1.0,
                 speedup_vs_ar=None if r["peer"] else 1.0, agreement_with_ar=1.0,
                 exact_match_with_ar=1.0, pass_at_1=None, compile_seconds=0.0)
    table = markdown_table(recs).splitlines()
    assert "| speedup without prefill |" in table[0] and table[3].split(" | ")[7] == "2.00x"
    assert table[5].split(" | ")[5:8] == ["-", "-", "-"]  # the peer: no ratio to AR's decode loop
    add_decode_only(recs, 12.0)  # a baseline as long as AR's run: nothing to tell
    assert [r["decode_speedup_vs_ar"] for r in recs] == [None] * 4
    # the column still stands (the baseline was measured), every cell '-': the table's shape
    # depends on the options, not on timing noise
    table = markdown_table(recs).splitlines()
    assert "| speedup without prefill |" in table[0] and table[1].count("|---") == 12
    assert all(row.split(" | ")[7] == "-" for row in table[2:])


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "0"], "--batch-sizes must be positive"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--modes", "ar,fast"], "--modes: unknown 'fast'; choose from ar, threshold"),
    (["--layouts", "4y"], "--layouts: '4y' is not a layout; write K x G as 6x2"),
    (["--layouts", "6x2,1x2"], "--layouts: '1x2': K must be >= 2"),
    (["--lossless-blocks", "4y"], "--lossless-blocks: '4y' is not a layout"),  # the flag as typed
    (["--layouts", "6x2", "--lossless-blocks", "6x2"], "--lossless-blocks is the old spelling of --layouts"),
    (["--modes", "ar,threshold", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--modes", "ar,verify", "--tau-vs=-0.5"], "--tau-vs are verifier probabilities"),
    (["--modes", "ar,lossless", "--head-thresholds", "0.3"], "--head-thresholds sweeps verify's commit head"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
    (["--model", "/nonexistent/ckpt"], "model checkpoint not found"),
    (["--dtype", "bfloat16", "--modes", "ar,hf_greedy"], "the transformers peers run float32"),
    # peers would time the 4M-parameter checkpoint on disk against our inflated 0.5B shape
    (["--inflate", "qwen2.5-0.5b", "--modes", "ar,hf_greedy"], "not inflated to qwen2.5-0.5b: add --no-peers"),
    (["--modes", "ar,threshold", "--taus", ""], "--taus is empty but threshold is in --modes"),
    # no lossless setting left: it ran ar alone without a word
    (["--modes", "ar,lossless", "--layouts", "", "--no-adaptive"],
     "--layouts is empty and --no-adaptive is set but lossless is in --modes"),
    (["--humaneval", "200"], "HumanEval has 164 problems; asked for 200"),
    (["--md", "{tmp}"], "is a directory"),  # found before the run, not after it
    (["--png", "{tmp}"], "is a directory"),
    (["--md", "{tmp}/b.json"], "--json and --md name the same file"),  # the JSON replaced the report
    # the peers named in --modes were dropped without a word
    (["--modes", "ar,hf_greedy", "--no-peers"], "--modes names hf_greedy but --no-peers leaves the peers out"),
    (["--modes", "ar,verify", "--rules", "prob,best"], "--rules: unknown 'best'; choose from top1, prob, head"),
    (["--modes", "ar,verify", "--rules", ""], "--rules '' leaves verify nothing to run"),
])
def test_benchmark_bad_input_one_line_error_no_files(pair, tmp_path, capsys, argv, message):
    args = ["--model", pair[0], "--verifier", pair[1], "--humaneval", "1", "--json",
            str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md"), "--png", str(tmp_path / "b.png")]
    rc = benchmark.main(args + [a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    # one line, the last (progress lines may come before it)
    assert rc == 2 and err.splitlines()[-1].startswith("error: ") and message in err.splitlines()[-1], err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--confidence", "certainty"], "argument --confidence: invalid choice: 'certainty'"),
    (["--dtype", "float8"], "argument --dtype: invalid choice"),
])
def test_benchmark_choices_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        benchmark.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--block-size", "1"], "--block-size must be >= 2, got 1"),
    (["--groups", "0"], "--groups must be >= 1, got 0"),
    (["--num-prompts", "2", "--show", "2"], "--show must be in [0, 2) (--num-prompts), got 2"),
    (["--tau", "0.5"], "--tau applies to the lossy modes: add --lossy"),
    (["--commit-rule", "prob"], "--commit-rule applies to the lossy modes: add --lossy"),
    (["--lossy", "--commit-rule", "head"], "--commit-rule head needs a commit head in"),
    # more prompts than HumanEval has: said before decoding (--show 170 used to fail after the run)
    (["--num-prompts", "200", "--show", "170"], "HumanEval has 164 problems; asked for 200"),
])
def test_demo_bad_input_one_line_error_naming_the_flag(pair, capsys, argv, message):
    assert demo.main(["--model", pair[0], "--verifier", pair[1], "--inflate", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--commit-rule", "top2"], "argument --commit-rule: invalid choice: 'top2'"),
    (["--confidence", "certainty"], "argument --confidence: invalid choice"),
    (["--inflate", "qwen9-huge"], "argument --inflate: invalid choice: 'qwen9-huge'"),
])
def test_demo_choices_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_benchmark_interrupted_says_where_the_finished_batch_sizes_are(pair, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    measure, calls = bench_lib.measure_batch, []

    def measure_then_interrupt(runners, *a, **k):  # Ctrl-C during batch size 2
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(runners, *a, **k)

    monkeypatch.setattr(bench_lib, "measure_batch", measure_then_interrupt)
    rc = benchmark.main(["--model", pair[0], "--verifier", pair[1], "--humaneval", "1",
                         "--max-new-tokens", "2", "--batch-sizes", "1,2", "--repeats", "1",
                         "--modes", "ar", "--no-peers", "--json", f"{out}.json", "--md", f"{out}.md",
                         "--png", "none"])
    err = capsys.readouterr().err
    assert rc == 130 and "stopped" in err and "Traceback" not in err and "bench.json.partial" in err
    assert (tmp_path / "bench.json.partial").exists() and not (tmp_path / "bench.json").exists()


def test_long_prompts_lead_with_the_others_and_end_with_their_own():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    long = long_prompts(prompts, 8)
    assert [len(p) for p in long] == [8, 8, 8]
    assert long[0] == [7, 8, 9, 4, 5, 1, 2, 3]  # ... prompt 2, prompt 1, then its own
    assert long[2] == [5, 1, 2, 3, 6, 7, 8, 9]  # cyclic: prompts 1 and 0 lead
    assert long_prompts([[1, 2, 3]], 7) == [[3, 1, 2, 3, 1, 2, 3]]  # alone: itself again
    assert long_prompts(prompts, 2) == prompts  # already that long: kept whole


def test_benchmark_long_context_run_times_prompts_of_that_length_ungraded(pair, tmp_path, capsys):
    out = tmp_path / "long"
    rc = benchmark.main(["--model", pair[0], "--humaneval", "2", "--prompt-tokens", "300",
                         "--max-new-tokens", "3", "--batch-sizes", "1", "--repeats", "1",
                         "--modes", "ar,lossless", "--layouts", "2x2", "--no-adaptive", "--no-peers",
                         "--out", str(out), "--png", "none"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "long.json").read_text())
    assert "to 300 tokens (not graded)" in doc["meta"]["prompts"] and not doc["meta"]["graded"]
    ar, lossless = doc["records"]
    assert ar["mode"] == "ar" and lossless["exact_match_with_ar"] == 1.0


def test_benchmark_reports_go_under_runs_unless_asked(pair, tmp_path, monkeypatch, capsys):
    """A plain run never replaces a committed report: it writes runs/benchmark/decode.*
    (git-ignored) under the working directory; `--out PREFIX` names the trio, and
    --json/--md/--png still name one file each."""
    args = benchmark.parse_args([])
    assert (args.json, args.md, args.png) == tuple(
        os.path.join("runs", "benchmark", f"decode.{ext}") for ext in ("json", "md", "png"))
    args = benchmark.parse_args(["--out", "benchmarks/decode_x", "--md", "elsewhere.md"])
    assert (args.json, args.md, args.png) == ("benchmarks/decode_x.json", "elsewhere.md",
                                              "benchmarks/decode_x.png")
    committed = os.path.join(REPO, "benchmarks")
    before = {f: os.stat(os.path.join(committed, f)).st_mtime_ns for f in os.listdir(committed)}
    monkeypatch.chdir(tmp_path)  # where runs/ does not exist yet
    rc = benchmark.main(["--model", pair[0], "--verifier", pair[1], "--humaneval", "1",
                         "--max-new-tokens", "2", "--batch-sizes", "1", "--repeats", "1",
                         "--modes", "ar", "--no-peers"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    assert sorted(os.listdir(tmp_path / "runs" / "benchmark")) == ["decode.json", "decode.md", "decode.png"]
    assert json.loads((tmp_path / "runs" / "benchmark" / "decode.json").read_text())["records"][0]["mode"] == "ar"
    assert {f: os.stat(os.path.join(committed, f)).st_mtime_ns for f in os.listdir(committed)} == before


def test_positive_ints_as_an_argparse_type_names_the_option():
    assert positive_ints("1, 4,16") == [1, 4, 16]
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=arg_type(lambda t: positive_ints(t, "--chunks")))
    assert ap.parse_args(["--chunks", "16,32"]).chunks == [16, 32]
    for bad, message in [("8,x", "--chunks must be comma-separated integers"),
                         ("0,8", "--chunks must be positive integers"), ("", "must be positive")]:
        with pytest.raises(SystemExit):
            ap.parse_args(["--chunks", bad])
        with pytest.raises(BenchError, match=message):
            positive_ints(bad, "--chunks")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(REPO, "README.md")) as readme:
    README_SCRIPTS = sorted(set(re.findall(r"`benchmarks/(bench_\w+\.py)`", readme.read())))


def test_the_readme_names_every_benchmark_script():
    scripts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "benchmarks", "bench_*.py")))
    assert scripts and README_SCRIPTS == scripts


@pytest.fixture(scope="module")
def script_help(tmp_path_factory):
    """{script: (exit code, stdout, stderr)} of `python benchmarks/SCRIPT --help` run from another
    directory without PYTHONPATH, for every script the README names."""
    # one interpreter's jax and flax shared by the launches (tests/prewarmed.py): nine of the
    # scripts import them, seconds each; finding prove_jax stays each script's own
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return prewarmed.run_each({s: [os.path.join(REPO, "benchmarks", s), "--help"] for s in README_SCRIPTS},
                              tmp_path_factory.mktemp("elsewhere"), env, tmp_path_factory.mktemp("logs"))


@pytest.mark.parametrize("script", README_SCRIPTS)
def test_benchmark_scripts_run_as_the_readme_says(script, script_help):
    """`python benchmarks/bench_X.py` as the README's benchmark table gives it, here from another
    directory and without PYTHONPATH: four of them stopped at `import prove_jax`."""
    code, stdout, stderr = script_help[script]
    assert code == 0, stderr[-2000:]
    assert stdout.startswith("usage:"), stdout[:500]


def test_a_setting_that_chose_ar_reports_ars_own_timing():
    """Adaptive/calibrated lossless that ran plain AR at a batch size is AR: its row gives AR's
    timing and 1.00x, labelled so, not a ratio of two timings of one program (noise: 1.11x)."""
    from prove_jax.decoding import DecodeOptions
    ar = Measurement(ar_setting(), 1, outputs=[[1, 2, 3]], proposer_forwards=3,
                     seconds=[1.0, 1.2])
    chose_ar = Measurement(calibrated_setting(8), 1, outputs=[[1, 2, 3]], proposer_forwards=3,
                           seconds=[0.9, 0.95], effective_options=DecodeOptions("ar"))
    rec = make_record(chose_ar, ar, 3, 1)
    assert rec["ran_as_ar"] and rec["speedup_vs_ar"] == rec["speedup_fastest_vs_ar"] == 1.0
    assert rec["tokens_per_second"] == ar.tokens_per_second
    rec.update(compile_seconds=0.0)
    row = markdown_table([rec]).splitlines()[2]
    assert "calibrated,K<=8 (chose ar: AR's timing)" in row and "| 1.00x | 1.00x |" in row
    lossless = Measurement(lossless_setting(4, 2), 1, outputs=[[1, 2, 3]], proposer_forwards=1,
                           seconds=[0.5])
    assert make_record(lossless, ar, 3, 1)["speedup_vs_ar"] == pytest.approx(2 * 1.1)
