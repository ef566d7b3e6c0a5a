"""Train a proposer (MARS) or verifier (AR) from one YAML config.

    prove-jax train --config configs/tiny.yaml [key=value ...] [--dry-run]
    prove-jax train --config configs/X.yaml --coordinator HOST:PORT --num-processes N --process-id I

Overrides use the config's dotted keys (`steps=50`, `optimizer.lr=3e-4`, `data=PATH`,
`run_dir=DIR`, `objective=ar`, `block_size=8`, `seed=1`). A run resumes automatically from the
newest checkpoint in its run_dir. On SIGTERM (a preemption) every host saves the same step and
the command exits 75 (`preemption.PREEMPTED`); rerun it to continue.
"""

from __future__ import annotations

import argparse
import os
import sys

from prove_jax import distributed
from prove_jax.cli.runner import INTERRUPTED, fail, run_cli
from prove_jax.errors import ProveJaxError
from prove_jax.training.preemption import PREEMPTED, Preempted


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prove-jax train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML training config (see configs/)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, dotted keys for nested sections (e.g. optimizer.lr=1e-4)",
    )
    p.add_argument("--dry-run", action="store_true",
                   help="lower the train step on an abstract mesh of the configured size (TPU "
                        "lowering, no weights allocated) and print per-device memory vs the chip")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="--dry-run: the estimate only, even where libtpu could compile the step for "
        "the chip's TPU slice (minutes for a 32B model)",
    )
    p.add_argument("--chip", default=None,
                   help="target chip for --dry-run (v5p, v5e, v4, v6e, H100, H200); "
                        "default: the config's target_chip")
    distributed.add_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a jax.profiler trace of a few train steps after warm-up to DIR (xprof "
        "or TensorBoard's profile plugin; each traced step is named train_step)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    # intermixed: overrides may come after an option (`steps=2 --dry-run run_dir=X`)
    args = build_parser().parse_intermixed_args(argv)
    if args.dry_run and not os.environ.get("JAX_PLATFORMS"):
        import jax  # abstract and libtpu-topology devices only: never probe for local accelerators
        jax.config.update("jax_platforms", "cpu")
    cfg = None
    try:
        from prove_jax.training.config import load_config
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from prove_jax.training.dry_run import dry_run
            report = dry_run(cfg, chip=args.chip, compile=not args.no_compile)
            print(report.describe())
            return 0
        distributed.initialize_from_args(args)
        if cfg.objective == "commit_head":
            from prove_jax.training.commit_head_training import train_commit_head
            train_commit_head(cfg, show_bar=not args.no_progress)
            return 0
        from prove_jax.training.loop import train  # noqa: after initialize
        result = train(cfg, show_bar=not args.no_progress, profile=args.profile)
        last = result.records[-1] if result.records else None
        if last is not None:
            print(f"step {result.final_step}: loss {last['loss']:.4f}; run dir {result.run_dir}")
        return 0
    except Preempted:  # the loop said which step it saved; every host exits with this code
        return PREEMPTED
    except (ProveJaxError, FileNotFoundError) as e:
        return fail(e)
    except KeyboardInterrupt:  # checkpoints are written atomically: the newest finished one stands
        from prove_jax.training.run_checkpoint import CHECKPOINT_DIR
        if cfg is None:
            how = ""
        elif cfg.objective == "commit_head":  # a few minutes' run that keeps no checkpoints
            how = "; the commit head keeps no checkpoints: rerun the same command to train it again"
        else:
            how = (f"; rerun the same command to resume from the newest checkpoint in "
                   f"{os.path.join(cfg.run_dir, CHECKPOINT_DIR)}")
        print("interrupted" + how, file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    run_cli(main)
