"""Launching one job as two processes on loopback, 4 simulated CPU devices each (one 8-device
mesh), as the multi-host tests do: the same environment and time limits for all of them."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
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


class CommandsJob:
    """Several commands run one after another in the same two processes, one job: the first
    joins it (its launch options are added), the rest run in the joined processes as a later
    command of a pod's script would. Each command's stdout and stderr are kept apart, at the
    file descriptors, so what the runtime prints lands with the command that made it. One launch
    instead of one per command: the interpreter start-up, imports and join are paid once.

    A command is `[MODULE, *ARGS]` (a module whose `main(ARGS)` returns the exit code, as every
    CLI's does) or `[SCRIPT.py, *ARGS]` (run as __main__ with that sys.argv). Started at
    construction; `results()` waits for both processes (both must exit 0) and returns, per
    command, [host 0's, host 1's] CompletedProcess of its output."""

    def __init__(self, commands: list[list[str]], folder: str):
        self.commands, self.folder = commands, str(folder)
        spec = os.path.join(self.folder, "commands.json")
        with open(spec, "w") as f:
            json.dump({"commands": commands, "logs": self.folder}, f)
        self.procs = start_two_processes(
            lambda i, port: ["-m", "tests.multihost", spec, str(i), str(port)])
        self._results = None

    def results(self) -> list[list[subprocess.CompletedProcess]]:
        if self._results is None:
            finish_two_processes(self.procs)
            self._results = [[subprocess.CompletedProcess(cmd, 0, *(_read(_log(self.folder, k, i) + ext)
                                                                   for ext in (".out", ".err")))
                              for i in range(2)] for k, cmd in enumerate(self.commands)]
        return self._results

    def stop(self) -> None:
        """Ends a job no test waited for (a worker that ran none of its tests)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.communicate()


def _log(folder: str, command: int, process_id: int) -> str:
    return os.path.join(folder, f"command{command}.host{process_id}")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def _output_to(log: str):
    """Descriptors 1 and 2 (Python's prints and the runtime's alike) into LOG.out and LOG.err."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def _run_one(target: str, args: list[str]) -> int:
    sys.argv = [target, *args]  # what the launch-facts check and scripts read
    if not target.endswith(".py"):
        return importlib.import_module(target).main(args)
    try:
        runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


def _run_commands(spec_path: str, process_id: int, port: int) -> int:
    """One host's side of a CommandsJob; the first failing command's exit code (its stderr's
    tail on this process's stderr)."""
    spec = json.loads(_read(spec_path))
    for k, (target, *args) in enumerate(spec["commands"]):
        if k == 0:
            args += joining(process_id, port)
        log = _log(spec["logs"], k, process_id)
        with _output_to(log):
            code = _run_one(target, args)
        if code:
            sys.stderr.write(f"command {k} {target} exited {code}:\n{_read(log + '.err')[-3000:]}")
            return code
    return 0


if __name__ == "__main__":
    sys.exit(_run_commands(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
