"""`prove-jax task arithmetic --out DIR`: write a synthetic task's train and test sets.

arithmetic: 1-3 step word problems with worked solutions (prove_jax/data/arithmetic.py).
Writes DIR/train.jsonl ({"prompt", "response"} pairs for `prove-jax train`), DIR/test.jsonl
(`{"id", "prompt", "answer", "grader": "last_number", ...}` records for `prove-jax benchmark
--prompts`) and DIR/manifest.json. The split is by a hash of each problem, so train and test
never share a problem whatever the seed.
"""

from __future__ import annotations

import argparse

from prove_jax.errors import ProveJaxError
from prove_jax.cli.runner import fail, run_cli
from prove_jax.data import arithmetic

TASKS = ("arithmetic",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prove-jax task", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=TASKS, help="the task to write")
    parser.add_argument(
        "--out", required=True, help="output directory (created; its three files replaced)"
    )
    parser.add_argument(
        "--train", type=int, default=20000, help="training problems (default 20000)"
    )
    parser.add_argument("--test", type=int, default=300, help="test problems (default 300)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the problem stream (default 0)"
    )
    parser.add_argument("--test-percent", type=int, default=arithmetic.DEFAULT_TEST_PERCENT,
                        help="share of problems (by prompt hash) in the test split "
                             f"(default {arithmetic.DEFAULT_TEST_PERCENT})")
    args = parser.parse_args(argv)
    try:
        m = arithmetic.write_task(args.out, args.train, args.test, args.seed, args.test_percent)
    except (ProveJaxError, OSError) as e:
        return fail(e)
    print(f"wrote {args.out}: {m['train']} train and {m['test']} test problems (seed {m['seed']})")
    return 0


if __name__ == "__main__":
    run_cli(main)
