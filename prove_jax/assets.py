"""Where the shipped demo models live (inside the package, so they install with it)."""

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_models")
DEMO_PROPOSER = os.path.join(DEMO_DIR, "proposer")
DEMO_VERIFIER = os.path.join(DEMO_DIR, "verifier")
