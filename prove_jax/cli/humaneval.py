"""`prove-jax humaneval --out prompts.jsonl [--limit N]`: HumanEval prompts as `{id, prompt}` JSONL,
the input format of `prove-jax generate`."""

from __future__ import annotations

import argparse
import json

from prove_jax.errors import ProveJaxError
from prove_jax.cli.runner import fail, run_cli
from prove_jax.evaluation.humaneval import load_problems, prompt_records
from prove_jax.files import atomic_write_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prove-jax humaneval",
                                     description="Write HumanEval prompts as {id, prompt} JSONL.")
    parser.add_argument("--out", required=True, help="output JSONL path")
    parser.add_argument("--limit", type=int, default=None, help="first N problems only")
    args = parser.parse_args(argv)
    try:
        records = prompt_records(load_problems(limit=args.limit))
        atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in records))
    except (ProveJaxError, OSError) as e:
        return fail(e)
    print(f"wrote {len(records)} HumanEval prompts to {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
