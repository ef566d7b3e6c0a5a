"""Launching one job as two processes on loopback, 4 simulated CPU devices each (one 8-device
mesh), as the multi-host tests do: the same environment and time limits for all of them."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

from tests.prewarmed import RUN_ARGV
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


def host_env() -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=xla_flags(devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)


def start_two_processes(argv_of: Callable[[int, int], list[str]]) -> list["HostProcess"]:
    """The launch of `run_two_processes`, returning at once (`finish_two_processes` waits).
    Each process is `python ARGV` forked from this test process's pre-warmed interpreter
    (`HostPool`), not a fresh one."""
    port = free_port()
    return [HostPool.shared().launch(argv_of(i, port), host_env()) for i in range(2)]


# The host interpreter: imports the libraries and project modules the host processes load (jax,
# flax, optax, orbax; transformers and torch by way of the tokenizer: seconds per process on the
# loaded 2 cores), starting no JAX backend, then forks one child per launch; the child takes that
# launch's argv, sys.path, environment and output files, so it starts as `python ARGV` would (its
# JAX runtime, distributed join and devices its own). Reaped children's exit codes go to LOG.code.
HOST_SERVER = r"""
import atexit, json, os, select, signal
""" + RUN_ARGV + r"""
import flax.nnx, jax, jax.numpy, numpy, optax, orbax.checkpoint  # noqa: F401
import prove_jax.checkpoints.convert, prove_jax.cli.distill, prove_jax.cli.evaluate  # noqa: F401
import prove_jax.cli.generate, prove_jax.cli.train, prove_jax.data.pipeline  # noqa: F401
import prove_jax.decoding.loading, prove_jax.training.loop, prove_jax.training.model_source  # noqa: F401
from jax._src import xla_bridge
assert not xla_bridge._backends, "a backend started before the fork"
logs = {}

def child(argv, env, log):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, ext in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    signal.alarm(300)  # what `timeout 300` gave a launch
    os.environ.clear()
    os.environ.update(env)
    code = run_argv(argv)
    atexit._run_exitfuncs()  # as at an interpreter's exit: JAX leaves the job (its shutdown barrier)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def reap():
    while logs:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        log = logs.pop(pid)
        with open(log + ".code.tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(log + ".code.tmp", log + ".code")

while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.05)
    reap()
    if not ready:
        continue
    line = sys.stdin.readline()
    if not line:
        break
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request["argv"], request["env"], request["log"])
    logs[pid] = request["log"]
    print(pid, flush=True)
"""


class HostProcess:
    """One launch forked by the `HostPool`: `subprocess.Popen`'s args, returncode, poll,
    communicate and terminate."""

    def __init__(self, args: list[str], pid: int, log: str):
        self.args, self.pid, self.log, self.returncode = args, pid, log, None

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self.log + ".code"):
            self.returncode = int(_read(self.log + ".code"))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return _read(self.log + ".out"), _read(self.log + ".err")

    def terminate(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)


class HostPool:
    """This test process's host interpreter (HOST_SERVER), started at its first launch and
    ended with this process (its stdin closes)."""

    _shared: "HostPool | None" = None

    @classmethod
    def shared(cls) -> "HostPool":
        if cls._shared is None or cls._shared.server.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def __init__(self):
        self.server = subprocess.Popen([sys.executable, "-c", HOST_SERVER], cwd=REPO, env=host_env(),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.logs = tempfile.mkdtemp(prefix="hosts-")
        self.count = 0

    def launch(self, argv: list[str], env: dict[str, str]) -> HostProcess:
        log = os.path.join(self.logs, f"launch{self.count}")
        self.count += 1
        self.server.stdin.write(json.dumps({"argv": argv, "env": env, "log": log}) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, "the host interpreter exited"
        return HostProcess(["python", *argv], int(line), log)


def finish_two_processes(procs: list[HostProcess], check: bool = True
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
