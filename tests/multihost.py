"""Launching one job as two processes on loopback, 4 simulated CPU devices each (one 8-device
mesh), as the multi-host tests do: the same environment and time limits for all of them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Callable

from tests.xla_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(argv_of: Callable[[int, int], list[str]], check: bool = True
                      ) -> list[subprocess.CompletedProcess]:
    """`python ARGV` for process 0 and 1, `argv_of(process_id, coordinator_port)`, run together;
    with `check`, both must exit 0 (the failing one's stderr tail is the assertion message)."""
    return finish_two_processes(start_two_processes(argv_of), check)


def start_two_processes(argv_of: Callable[[int, int], list[str]]) -> list[subprocess.Popen]:
    """The launch of `run_two_processes`, returning at once (`finish_two_processes` waits)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port = free_port()
    return [subprocess.Popen(["timeout", "300", sys.executable, *argv_of(i, port)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def finish_two_processes(procs: list[subprocess.Popen], check: bool = True
                         ) -> list[subprocess.CompletedProcess]:
    done = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=330)
        assert p.returncode == 0 or not check, f"process {i}:\n{err[-3000:]}"
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def joining(process_id: int, port: int) -> list[str]:
    """The command-line options that make a CLI process `process_id` of the two."""
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
            "--heartbeat-timeout", "20"]
