"""`prove-jax generate --dry-run v5p-8`: compile the decode program for a TPU slice, report it.

    prove-jax generate --dry-run v5p-8 --model qwen2.5-32b --verifier qwen2.5-3b --mode verify \\
        --block-size 16 --batch-size 16 --context 8192 --dtype bfloat16 --scan-layers

`--model` and `--verifier` are checkpoint directories (only their configs are read) or preset
names; a preset proposer gets a `<|mask|>` id in its padded vocabulary rows (shapes are what
matter). The report: the mesh `generate` would pick on the slice, the weights per chip, and
XLA's per-chip memory, compile time and collectives (prove_jax/decoding/dry_run.py).

With `--report FILE` it compiles instead the programs `generate` streams (one decode step of
the chunk loop, the prefill, an admission) and writes what each moves through HBM per
execution against what it must, its FLOPs and roofline time (prove_jax/decoding/step_report.py,
docs/decoding.md "Reading the step-cost report"), and prints the same as a table.
"""

from __future__ import annotations

import os
import sys

from prove_jax import aot
from prove_jax.checkpoints.checkpoint import load_config
from prove_jax.decoding import DecodeError, DecodeOptions
from prove_jax.models.config import PRESETS, ModelConfig, preset


def model_config(spec: str, flag: str, proposer: bool) -> ModelConfig:
    """The config of a checkpoint directory or a preset name."""
    if os.path.isdir(spec):
        return load_config(spec)
    if spec.lower() not in PRESETS:
        raise DecodeError(f"{flag} {spec}: neither a checkpoint directory nor a preset "
                          f"({', '.join(PRESETS)})")
    cfg = preset(spec)
    if proposer and cfg.mask_token_id is None:  # shape-neutral: a padded vocabulary row
        cfg = cfg.replace(mask_token_id=cfg.vocab_size - 1)
    return cfg


def run_dry_run(args, options: DecodeOptions) -> int:
    """Compile and print the report; exit 0 when the program fits a chip, 1 when it does not."""
    from prove_jax.decoding.dry_run import SliceRun, dry_run_decode
    chip, chips = aot.accelerator_chips(args.dry_run)
    proposer = model_config(args.model, "--model", proposer=True)
    verifier = None
    if options.mode == "verify":
        if args.verifier is None:
            raise DecodeError(
                "--mode verify needs --verifier (a checkpoint or a preset) with --dry-run"
            )
        verifier = model_config(args.verifier, "--verifier", proposer=False)
    run = SliceRun(proposer, options, chip=chip, chips=chips, batch=args.batch_size,
                   context=args.context, new_tokens=args.max_new_tokens, verifier=verifier,
                   dtype=args.dtype)
    if getattr(args, "report", None):
        return _run_report(args, run)
    print(f"compiling the {options.mode} decode program for {args.dry_run} ({chips} x {chip}) ...",
          file=sys.stderr, flush=True)
    report = dry_run_decode(run)
    print(report.describe())
    return 0 if report.fits else 1


def _run_report(args, run) -> int:
    """The step-cost report: written to args.report (JSON) and printed; exit 1 when a program
    does not fit a chip."""
    from prove_jax.decoding.step_report import step_report
    if os.path.isdir(args.report):
        raise DecodeError(f"--report {args.report} is a directory; give the JSON file to write")
    print(
        f"compiling the {run.options.mode} stream programs (step, prefill, admission) for "
        f"{args.dry_run} ({run.chips} x {run.chip}) ...",
        file=sys.stderr,
        flush=True,
    )
    report = step_report(run)
    report.write(args.report)
    print(report.table())
    return 1 if report.does_not_fit else 0
