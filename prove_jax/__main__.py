"""`python -m prove_jax COMMAND ...`: the same as `prove-jax COMMAND ...`."""

from prove_jax.cli.main import main

if __name__ == "__main__":
    main()
