"""`python -m train.train` from the repository root: the same command as `prove-jax train` (prove_jax/cli/train.py)."""

from prove_jax.cli.train import main
from prove_jax.cli.runner import run_cli

__all__ = ["main"]

if __name__ == "__main__":
    run_cli(main)
