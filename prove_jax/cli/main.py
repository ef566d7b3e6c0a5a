"""`prove-jax COMMAND ...`: one entry point for every command (also `python -m prove_jax`).

Each command's module is imported only when it runs: `prove-jax --help` answers without
loading jax.
"""

from __future__ import annotations

import importlib
import os
import sys

from prove_jax import __version__
from prove_jax.cli.runner import run_cli

# name -> (module under prove_jax.cli, one line for --help)
COMMANDS = {
    "generate": ("generate", "decode a JSONL of prompts (ar, threshold, lossless, verify)"),
    "serve": ("serve", "an OpenAI-compatible HTTP server on the compiled loop (docs/serving.md)"),
    "train": (
        "train",
        "train a proposer (MARS), a verifier (AR) or a commit head from a YAML config",
    ),
    "convert": ("convert", "convert checkpoints between HF safetensors and our orbax format"),
    "benchmark": ("benchmark", "measure every decoding mode against AR and the transformers peers"),
    "demo": (
        "demo",
        "complete HumanEval prompts with greedy AR and lossless (--lossy: the lossy modes too)",
    ),
    "corpus": ("corpus", "write the CPython standard library as a train / held-out corpus"),
    "distill": ("distill", "write self-distillation data: a proposer's own greedy continuations"),
    "evaluate": ("evaluate", "held-out NLL, perplexity and top-1 accuracy of checkpoints"),
    "humaneval": ("humaneval", "write HumanEval prompts as JSONL for generate"),
    "task": ("task", "write a synthetic task's train and test sets (arithmetic word problems)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: prove-jax COMMAND [options]   (prove-jax COMMAND --help for its options)",
             "", "ProVe / MARS block decoding in JAX.", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def dispatch(argv: list[str] | None = None) -> int:
    """Run the command named by argv[0] with the rest of argv; its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        sys.stderr.write(usage())
        return 2
    if argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    if argv[0] == "--version":
        print(f"prove-jax {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        sys.stderr.write(usage())
        print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    # transformers serves only tokenizers here: its "PyTorch was not found" advice is noise
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    module = importlib.import_module(f"prove_jax.cli.{COMMANDS[argv[0]][0]}")
    return module.main(argv[1:])


def main() -> None:
    """The `prove-jax` console script: Ctrl-C is one line and exit 130 (cli/runner.py)."""
    run_cli(dispatch)


if __name__ == "__main__":
    main()
