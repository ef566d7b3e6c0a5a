"""The synthetic arithmetic task (prove_jax/data/arithmetic.py, `prove-jax task`) and the shipped
arithmetic pair: the generator is deterministic, its split disjoint and its solutions right (checked
by evaluating every written equation), the shipped test set is the generator's, and the shipped
pair scores strictly between 0 and 100% under AR with lossless equal to AR token for token."""

import json
import os
import re
import sys

import pytest

from prove_jax import assets
from prove_jax.cli.main import dispatch
from prove_jax.data import arithmetic
from prove_jax.decoding.requests import read_requests
from prove_jax.evaluation import graders

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)\.")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def test_generator_is_deterministic_and_seeded():
    a = arithmetic.generate(200, 12, seed=5)
    assert a == arithmetic.generate(200, 12, seed=5)
    assert a != arithmetic.generate(200, 12, seed=6)
    train, test = a
    assert len(train) == 200 and len(test) == 12
    assert len({p.prompt for p in train}) == 200  # no repeats within a split


def test_split_is_disjoint_and_by_hash_of_the_problem():
    train, test = arithmetic.generate(3000, 90, seed=1)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert {p.split for p in train} == {"train"} and {p.split for p in test} == {"test"}
    # another seed draws other problems, but a prompt's split never changes
    train2, test2 = arithmetic.generate(3000, 90, seed=2)
    assert not {p.prompt for p in train2} & {p.prompt for p in test}
    assert not {p.prompt for p in train} & {p.prompt for p in test2}
    assert [p.steps for p in test[:6]] == [1, 2, 3, 1, 2, 3]  # an even step mix


def test_solutions_are_worked_correctly():
    """Every equation of a solution holds, each step starts from the previous result, the story's
    numbers are the operands, and the stated answer is the last result."""
    train, test = arithmetic.generate(500, 30, seed=3)
    for p in train + test:
        eqs = EQUATION.findall(p.solution)
        assert len(eqs) == p.steps, p.solution
        story_numbers = [int(n) for n in re.findall(r"\d+", p.prompt)]
        operands = [int(eqs[0][0])] + [int(b) for _, _, b, _ in eqs]
        assert operands == story_numbers, (p.prompt, p.solution)
        for i, (a, op, b, c) in enumerate(eqs):
            assert OPS[op](int(a), int(b)) == int(c), p.solution
            assert 0 <= int(c) <= arithmetic.MAX_VALUE
            if i:
                assert int(a) == int(eqs[i - 1][3])
        assert p.solution.endswith(f" The answer is {p.answer}.") and int(eqs[-1][3]) == p.answer


def test_last_number_grader_reads_the_worked_answer():
    _, test = arithmetic.generate(0, 9, seed=4)
    recs = [arithmetic.test_record(i, p) for i, p in enumerate(test)]
    refs = graders.record_references(recs)
    prompts = [r["prompt"] for r in recs]
    assert graders.grade(refs, prompts, [r["metadata"]["solution"] for r in recs]) == [True] * 9
    # the intermediate results do not count: only the final number does
    wrong = [r["metadata"]["solution"].replace(f"is {r['answer']}.", f"is {r['answer'] + 1}.") for r in recs]
    assert graders.grade(refs, prompts, wrong) == [False] * 9


def test_task_cli_writes_train_and_test(tmp_path, capsys):
    out = tmp_path / "task"
    assert dispatch(["task", "arithmetic", "--out", str(out), "--train", "40", "--test", "6",
                     "--seed", "7"]) == 0
    train = [json.loads(line) for line in open(out / "train.jsonl")]
    assert len(train) == 40 and set(train[0]) == {"prompt", "response"}
    test = read_requests(str(out / "test.jsonl"))
    expected = arithmetic.generate(40, 6, seed=7)[1]
    assert [r["prompt"] for r in test] == [p.prompt for p in expected]
    assert all(r["grader"] == "last_number" for r in test)
    assert json.load(open(out / "manifest.json"))["train"] == 40
    # bad counts: one line naming the problem, exit 2
    assert dispatch(["task", "arithmetic", "--out", str(out), "--train", "0", "--test", "0"]) == 2
    assert "positive number of problems" in capsys.readouterr().err


def test_shipped_test_set_is_the_generators():
    from build_arithmetic_models import TASK
    records = read_requests(assets.ARITH_TEST)
    _, test = arithmetic.generate(TASK["train"], TASK["test"], TASK["seed"])
    assert [r["prompt"] for r in records] == [p.prompt for p in test]
    assert [r["answer"] for r in records] == [p.answer for p in test]
    refs = graders.record_references(records)
    assert all(r.grader == "last_number" for r in refs)


@pytest.fixture(scope="module")
def arith_results():
    from prove_jax.decoding import DecodeOptions, LosslessRule
    from prove_jax.decoding.loading import build_decoder
    records = read_requests(assets.ARITH_TEST)[:12]
    ar, tok = build_decoder(assets.ARITH_PROPOSER, DecodeOptions("ar"))
    ids = [tok.encode(r["prompt"]) for r in records]
    ref = ar.generate(ids, 48)
    lossless = ar.with_options(DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2))).generate(ids, 48)
    return records, tok, ref, lossless


def test_shipped_arith_pair_scores_between_0_and_100_percent(arith_results):
    records, tok, ref, _ = arith_results
    refs = graders.record_references(records)
    completions = [tok.decode(o, skip_special_tokens=True) for o in ref.output_ids]
    right = graders.grade(refs, [r["prompt"] for r in records], completions)
    assert 0 < sum(right) < len(right), completions
    # it writes worked solutions: an equation and a stated answer in every completion
    assert all(EQUATION.search(c) and "The answer is" in c for c in completions), completions


def test_shipped_arith_lossless_equals_ar(arith_results):
    _, _, ref, lossless = arith_results
    assert lossless.output_ids == ref.output_ids
    assert sum(map(len, lossless.output_ids)) > 1.5 * lossless.forwards.sum()  # it does propose
