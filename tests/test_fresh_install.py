"""The runtime requirements are complete: a venv holding requirements.txt alone (no test
dependency: torch, for one, pulls in jinja2, which chat templates need) runs a training dry run
of every paper config and a --chat completion with the shipped pair."""

import glob
import os
import subprocess
import sys

import pytest
from uv import find_uv_bin

from tests.decode_helpers import ROOT

pytestmark = pytest.mark.slow

# One process (one interpreter and JAX start-up): nothing of the test stack is importable, then
# the dry runs, then the chat completion through the `prove-jax` entry point's dispatch.
FRESH_VENV = """
import importlib.util as u, sys
print(u.find_spec("torch"), u.find_spec("pytest"), flush=True)
from prove_jax.cli.main import dispatch
for config in sys.argv[1:]:
    if dispatch(["train", "--config", config, "--dry-run", "--no-compile"]) != 0:
        sys.exit(f"train --dry-run failed for {config}")
print("dry runs done", file=sys.stderr, flush=True)
sys.exit(dispatch(["generate", "--prompt", "Write a function that adds two numbers.", "--chat",
                   "--max-new-tokens", "4", "--no-progress"]))
"""


def test_requirements_alone_run_the_paper_configs_and_chat(tmp_path):
    venv, uv = tmp_path / "venv", find_uv_bin()
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([uv, "pip", "install", "-q", "--python", python, "-r", os.path.join(ROOT, "requirements.txt")],
                   check=True)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)), "PYTHONPATH": ROOT,
           "JAX_PLATFORMS": "cpu"}
    run = lambda *args: subprocess.run([python, *args], env=env, cwd=ROOT, capture_output=True,  # noqa: E731
                                       text=True, timeout=600)
    configs = sorted(glob.glob(os.path.join(ROOT, "configs", "*qwen*.yaml")))
    assert len(configs) >= 4
    r = run("-c", FRESH_VENV, *configs)
    assert r.stdout.splitlines()[0].split() == ["None", "None"], r  # nothing of the test stack
    assert "dry runs done" in r.stderr, r.stderr[-3000:]
    chat = r.stderr.split("dry runs done")[-1]
    assert r.returncode == 0 and "tokens/forward" in chat, r.stderr[-3000:]
