"""`prove-jax corpus --out DIR`: the CPython standard library as a train / held-out corpus.

Writes DIR/train.jsonl, DIR/heldout.jsonl (records `{"path", "text"}`),
DIR/heldout_prompts.jsonl (records `{"id", "prompt", "reference"}`) and DIR/manifest.json; what
is held out and why is in prove_jax/data/corpus.py.
"""

from __future__ import annotations

import argparse
import sys

from prove_jax.errors import ProveJaxError
from prove_jax.cli.runner import fail, run_cli
from prove_jax.data.corpus import DEFAULT_HELDOUT_FRACTION, stdlib_root, write_corpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prove-jax corpus",
        description="Write the CPython standard library source as a train / held-out JSONL corpus.")
    parser.add_argument(
        "--out",
        required=True,
        help="output directory: new, empty, or an earlier corpus (replaced atomically)",
    )
    parser.add_argument("--root", default=None,
                        help="source tree to read (default: this interpreter's stdlib)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="cap on total corpus bytes (a hash-ordered sample of files)")
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION,
                        help="fraction of files held out, chosen by a hash of the path")
    parser.add_argument("--max-prompts", type=int, default=256,
                        help="number of held-out completion prompts to write")
    args = parser.parse_args(argv)
    try:
        print(f"reading {args.root or stdlib_root()} ...", file=sys.stderr)
        m = write_corpus(args.out, args.root, args.heldout_fraction, args.max_bytes,
                         args.max_prompts)
    except (ProveJaxError, OSError) as e:
        return fail(e)
    print(f"wrote {args.out}: train {m['train']['files']} files / {m['train']['bytes']:,} bytes, "
          f"held-out {m['heldout']['files']} files / {m['heldout']['bytes']:,} bytes, "
          f"{m['heldout_prompts']['records']} prompts")
    return 0


if __name__ == "__main__":
    run_cli(main)
