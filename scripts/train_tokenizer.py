"""Train the project's byte-level BPE tokenizer on a corpus written by `prove-jax corpus`.

    python scripts/train_tokenizer.py --corpus runs/corpus --out runs/tokenizer --vocab-size 4096

The logic lives in prove_jax/tokenizer_build.py; this is the command-line wrapper.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prove_jax.errors import ProveJaxError  # noqa: E402
from prove_jax.data.corpus import iter_texts  # noqa: E402
from prove_jax.data.tokenizer import DEFAULT_VOCAB_SIZE, build_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a Qwen2-style byte-level BPE tokenizer "
                                                 "(HF format) on a corpus directory.")
    parser.add_argument("--corpus", required=True,
                        help="corpus directory with train.jsonl (and heldout.jsonl, used to check "
                             "the saved tokenizer)")
    parser.add_argument("--out", required=True,
                        help="output tokenizer directory: new, empty, or an earlier tokenizer "
                             "(replaced atomically)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="total vocabulary size including the 4 special tokens")
    parser.add_argument("--verify-texts", type=int, default=20,
                        help="held-out texts re-encoded with transformers to check the saved folder")
    args = parser.parse_args(argv)
    if args.verify_texts < 0:  # islice would raise a bare ValueError
        parser.error(f"--verify-texts must be >= 0, got {args.verify_texts}")
    train_path = os.path.join(args.corpus, "train.jsonl")
    heldout_path = os.path.join(args.corpus, "heldout.jsonl")
    try:
        # Fail on a missing or malformed corpus before the trainer starts.
        next(iter_texts(train_path), None)
        samples = (list(itertools.islice(iter_texts(heldout_path), args.verify_texts))
                   if os.path.isfile(heldout_path) else [])
        print(f"training BPE (vocab {args.vocab_size}) on {train_path} ...", file=sys.stderr)
        info = build_tokenizer(iter_texts(train_path), args.out, args.vocab_size,
                               sample_texts=samples, show_progress=sys.stderr.isatty())
    except (ProveJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: vocab {info.vocab_size}, eos/pad {info.eos_token_id}, "
          f"mask {info.mask_token_id}; trained on {info.num_texts} texts / {info.num_bytes:,} "
          f"bytes in {info.train_seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
