"""`python -m infer.demo` from the repository root: the same command as `prove-jax demo` (prove_jax/cli/demo.py)."""

from prove_jax.cli.demo import main
from prove_jax.cli.runner import run_cli

__all__ = ["main"]

if __name__ == "__main__":
    run_cli(main)
