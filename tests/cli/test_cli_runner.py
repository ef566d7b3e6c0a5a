"""cli/runner.py: Ctrl-C exits 130 with one line on stderr; a command's own exit code passes
through."""

from __future__ import annotations

import os
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ctrl_c_exits_130_with_one_line_on_stderr():
    code = ("from prove_jax.cli.runner import run_cli\n"
            "def main():\n    raise KeyboardInterrupt\n"
            "run_cli(main)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr.strip()) == (130, "", "interrupted")
    r = subprocess.run([sys.executable, "-c", "from prove_jax.cli.runner import run_cli\nrun_cli(lambda: 3)\n"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
