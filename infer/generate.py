"""`python -m infer.generate` from the repository root: the same command as `prove-jax generate` (prove_jax/cli/generate.py)."""

from prove_jax.cli.generate import main
from prove_jax.cli.runner import run_cli

__all__ = ["main"]

if __name__ == "__main__":
    run_cli(main)
