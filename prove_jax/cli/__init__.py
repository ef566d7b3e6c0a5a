"""The `prove-jax` command: main.py dispatches to one module per subcommand, each with its
argparse and `main(argv) -> exit code`."""
