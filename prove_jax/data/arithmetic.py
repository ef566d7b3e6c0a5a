"""Synthetic arithmetic word problems with a worked solution: a task a few-million-parameter model
can learn partly, so that every decoding mode has an accuracy between 0 and 100%.

A problem is a short story of 1 to 3 steps over small whole numbers, asked as a question; its
solution writes each step as an equation and ends with the answer, GSM8K style:

    Q: Ann has 12 pens. Ann buys 7 more. Then Ann gives away 5. How many pens does Ann have now?
    A: 12 + 7 = 19. 19 - 5 = 14. The answer is 14.

The story may start with a product ("Ann has 3 boxes of 4 pens."). Every intermediate value stays
between 0 and `MAX_VALUE`, so subtraction never goes below zero.

The split is a function of the problem's text alone (a hash of the prompt), so the train and
test sets are disjoint whatever the seed or counts, and a test problem can never be trained on.
Train rows are `{"prompt", "response"}` pairs (data/pipeline.py appends EOS to the response);
test rows are benchmark prompt records `{"id", "prompt", "answer", "grader": "last_number",
"metadata": {"solution", "steps"}}` (evaluation/graders.py reads the last number of a completion).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random

from prove_jax.errors import ProveJaxError
from prove_jax.files import atomic_write_text


class TaskError(ProveJaxError, ValueError):
    """Task-generation settings that cannot produce what was asked."""


NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kim", "Leo",
         "Mia", "Ned", "Oda", "Pia", "Raj", "Sam", "Tia", "Uma", "Vic", "Wes", "Yan", "Zoe")
# (plural, container of several)
ITEMS = (("pens", "boxes"), ("apples", "bags"), ("cards", "packs"), ("stamps", "books"),
         ("marbles", "jars"), ("coins", "purses"), ("eggs", "cartons"), ("shells", "buckets"),
         ("stickers", "sheets"), ("books", "shelves"), ("cookies", "plates"), ("beads", "strings"),
         ("rocks", "crates"), ("pencils", "cups"), ("toys", "bins"), ("nuts", "bowls"))
GAINS = ("buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more", "makes {n} more")
LOSSES = ("gives away {n}", "loses {n}", "sells {n}", "uses {n}", "eats {n}")
MAX_VALUE = 99
"""Largest intermediate value."""
MAX_START = 50
"""Largest starting count (a product start is at most 9 * 9)."""
MAX_OPERAND = 20
"""Largest number added or taken away in one step: larger ones made the task too hard for the
4M-parameter demo proposer (docs/demo_models.md)."""
MAX_STEPS = 3
"""Most equations in a solution."""
DEFAULT_TEST_PERCENT = 10
"""Share of all possible problems (by prompt hash) that belongs to the test split."""


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    """`Q: <story and question>\\nA:` -- the text a model continues."""
    solution: str
    """` 12 + 7 = 19. 19 - 5 = 14. The answer is 14.` -- what a model should write after it."""
    answer: int
    steps: int

    @property
    def split(self) -> str:
        return split_of(self.prompt)


def split_of(prompt: str, test_percent: int = DEFAULT_TEST_PERCENT) -> str:
    """"test" or "train": a hash of the prompt text, so the split does not depend on the seed."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return "test" if h % 100 < test_percent else "train"


def make_problem(rng: random.Random, steps: int | None = None) -> Problem:
    """One problem of `steps` equations (1..MAX_STEPS; None: drawn uniformly)."""
    steps = rng.randint(1, MAX_STEPS) if steps is None else steps
    if not 1 <= steps <= MAX_STEPS:
        raise TaskError(f"steps must be in 1..{MAX_STEPS}, got {steps}")
    name = rng.choice(NAMES)
    items, container = rng.choice(ITEMS)
    equations = []
    if rng.random() < 0.25:  # start with a product: groups of equal size
        groups, size = rng.randint(2, 9), rng.randint(2, 9)
        value = groups * size
        story = [f"{name} has {groups} {container} of {size} {items}."]
        equations.append(f"{groups} * {size} = {value}.")
    else:
        value = rng.randint(2, MAX_START)
        story = [f"{name} has {value} {items}."]
    while len(equations) < steps:
        first = not story[1:]
        lead = name if first else f"Then {name}"
        if value == 0 or (value < MAX_VALUE and rng.random() < 0.5):
            n = rng.randint(1, min(MAX_OPERAND, MAX_VALUE - value))
            story.append(f"{lead} {rng.choice(GAINS).format(n=n)}.")
            equations.append(f"{value} + {n} = {value + n}.")
            value += n
        else:
            n = rng.randint(1, min(MAX_OPERAND, value))
            story.append(f"{lead} {rng.choice(LOSSES).format(n=n)}.")
            equations.append(f"{value} - {n} = {value - n}.")
            value -= n
    question = f"How many {items} does {name} have now?"
    prompt = "Q: " + " ".join(story + [question]) + "\nA:"
    solution = " " + " ".join(equations + [f"The answer is {value}."])
    return Problem(prompt, solution, value, steps)


def generate(num_train: int, num_test: int, seed: int = 0,
             test_percent: int = DEFAULT_TEST_PERCENT) -> tuple[list[Problem], list[Problem]]:
    """(train, test) problems, each list free of repeated prompts, drawn from one seeded stream.

    Each drawn problem goes to the split its prompt hashes to, until both lists are full, so the
    two never share a prompt. The test problems cycle through 1, 2, 3 steps for an even mix.
    """
    if num_train < 0 or num_test < 0 or num_train + num_test == 0:
        raise TaskError(f"need a positive number of problems, got train {num_train}, test "
                        f"{num_test}")
    if not 0 < test_percent < 100:
        raise TaskError(f"test_percent must be in 1..99, got {test_percent}")
    rng = random.Random(seed)
    train: list[Problem] = []
    test: list[Problem] = []
    seen: set[str] = set()
    tries = 0
    limit = 200 * (num_train + num_test) + 10_000
    while len(train) < num_train or len(test) < num_test:
        tries += 1
        if tries > limit:
            raise TaskError(f"could not draw {num_train} train and {num_test} test distinct "
                            f"problems (got {len(train)} and {len(test)} after {limit} draws)")
        steps = 1 + len(test) % MAX_STEPS if len(train) >= num_train else None
        p = make_problem(rng, steps)
        if p.prompt in seen:
            continue
        if split_of(p.prompt, test_percent) == "test":
            # keep the test set's step mix even: take a problem only when its step count is next
            if len(test) < num_test and p.steps == 1 + len(test) % MAX_STEPS:
                seen.add(p.prompt)
                test.append(p)
        elif len(train) < num_train:
            seen.add(p.prompt)
            train.append(p)
    return train, test


def train_record(p: Problem) -> dict:
    return {"prompt": p.prompt, "response": p.solution}


def test_record(i: int, p: Problem) -> dict:
    return {"id": f"arith-{i}", "prompt": p.prompt, "answer": p.answer, "grader": "last_number",
            "metadata": {"solution": p.solution, "steps": p.steps}}


def _jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def write_task(out_dir: str, num_train: int, num_test: int, seed: int = 0,
               test_percent: int = DEFAULT_TEST_PERCENT) -> dict:
    """Write out_dir/train.jsonl, out_dir/test.jsonl and out_dir/manifest.json; the manifest."""
    train, test = generate(num_train, num_test, seed, test_percent)
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_text(os.path.join(out_dir, "train.jsonl"), _jsonl(map(train_record, train)))
    atomic_write_text(os.path.join(out_dir, "test.jsonl"),
                      _jsonl(test_record(i, p) for i, p in enumerate(test)))
    manifest = {"task": "arithmetic", "seed": seed, "test_percent": test_percent,
                "train": len(train), "test": len(test), "max_value": MAX_VALUE,
                "max_start": MAX_START, "max_operand": MAX_OPERAND, "max_steps": MAX_STEPS}
    atomic_write_text(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    return manifest
