"""`prove-jax convert`: Qwen2 and Qwen3 (dense) checkpoints between HF safetensors and our orbax
format.

    prove-jax convert hf-to-flax --hf-dir HF_DIR --out CKPT [--dtype bfloat16] [--mesh 1,64,4]
    prove-jax convert flax-to-hf --ckpt CKPT --out HF_DIR [--dtype ...] [--max-shard-size 5GB]

The converter itself, and what it checks before reading any tensor, is
prove_jax/checkpoints/convert.py.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from prove_jax.checkpoints.convert import DEFAULT_MAX_SHARD_BYTES, DTYPES, flax_to_hf, hf_to_flax
from prove_jax.cli.runner import fail, run_cli
from prove_jax.errors import ProveJaxError


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count"
        )
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0])
    return int(float(m.group(1)) * base**power)


def parse_mesh(text: str) -> tuple[int, int, int]:
    """'1,64,4' -> (1, 64, 4): data, fsdp, tensor sizes, each a whole number >= 1."""
    parts = text.replace("x", ",").split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"bad mesh {text!r}; give data,fsdp,tensor sizes, each a "
                                         f"whole number >= 1, e.g. 1,64,4")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prove-jax convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "hf-to-flax", help="HF Qwen2 or Qwen3 safetensors dir -> prove-jax orbax checkpoint"
    )
    a.add_argument("--hf-dir", required=True, help="HF model dir: config.json + model.safetensors "
                   "or model.safetensors.index.json shards (+ tokenizer files, copied)")
    a.add_argument(
        "--out", required=True, help="checkpoint dir to create (must not exist or be empty)"
    )
    a.add_argument(
        "--dtype",
        choices=DTYPES,
        help="stored parameter dtype (default: the HF config's "
        "dtype when it is float32 or bfloat16; float16 and other sources are stored as float32)",
    )
    a.add_argument(
        "--compute-dtype",
        choices=DTYPES,
        help="matmul dtype recorded in the checkpoint "
        "config (default float32; bfloat16 is ~5x slower on CPU)",
    )
    a.add_argument(
        "--mesh",
        type=parse_mesh,
        help="data,fsdp,tensor sizes of the mesh the checkpoint "
        "will be loaded on (e.g. 1,64,4): each array is stored in chunks of its shards "
        "there, so that every host reads only its own (default: one chunk per array)",
    )
    b = sub.add_parser("flax-to-hf", help="prove-jax checkpoint -> HF dir loadable by transformers")
    b.add_argument("--ckpt", required=True, help="prove-jax checkpoint dir (config.json + params/)")
    b.add_argument("--out", required=True, help="HF dir to create (must not exist or be empty)")
    b.add_argument(
        "--dtype", choices=DTYPES, help="safetensors dtype (default: the checkpoint's param dtype)"
    )
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="split into model-0000X-of-0000N.safetensors + index above this size (default 5GB)",
    )
    for q in (a, b):
        q.add_argument(
            "--overwrite", action="store_true", help="replace an existing non-empty --out"
        )
        q.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    try:
        if args.command == "hf-to-flax":
            cfg = hf_to_flax(args.hf_dir, args.out, args.dtype, args.compute_dtype, args.overwrite,
                             progress=not args.quiet, mesh=args.mesh)
            what = f"{cfg.num_params / 1e6:.1f}M params, {cfg.param_dtype}"
        else:
            files = flax_to_hf(args.ckpt, args.out, args.dtype, args.max_shard_size, args.overwrite,
                               progress=not args.quiet)
            what = f"{len(files)} safetensors file(s)"
    except ProveJaxError as e:
        return fail(e)
    except OSError as e:
        print(
            f"error: {e.strerror or e} ({e.filename})" if e.filename else f"error: {e}",
            file=sys.stderr,
        )
        return 2
    if not args.quiet:
        print(
            f"{args.command}: wrote {args.out} ({what}) in {time.monotonic() - start:.1f}s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    run_cli(main)
