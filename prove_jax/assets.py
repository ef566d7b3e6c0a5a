"""Where the shipped demo models live (inside the package, so they install with it)."""

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_models")
DEMO_PROPOSER = os.path.join(DEMO_DIR, "proposer")
DEMO_VERIFIER = os.path.join(DEMO_DIR, "verifier")
# the demo pair fine-tuned on synthetic arithmetic word problems, and that task's test set
# (scripts/build_arithmetic_models.py; docs/demo_models.md)
ARITH_PROPOSER = os.path.join(DEMO_DIR, "arith_proposer")
ARITH_VERIFIER = os.path.join(DEMO_DIR, "arith_verifier")
ARITH_TEST = os.path.join(DEMO_DIR, "arith_test.jsonl")
