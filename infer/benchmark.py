"""`python -m infer.benchmark` from the repository root: the same command as `prove-jax benchmark` (prove_jax/cli/benchmark.py)."""

from prove_jax.cli.benchmark import main
from prove_jax.cli.runner import run_cli

__all__ = ["main"]

if __name__ == "__main__":
    run_cli(main)
