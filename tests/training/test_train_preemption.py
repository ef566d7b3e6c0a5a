"""Preemption: a SIGTERM during the steps saves one step on every host, the run stops with
PREEMPTED and a line saying what to do, and the relaunch continues exactly: its losses and
final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from prove_jax.training import loop as trainer
from prove_jax.training.config import load_config
from prove_jax.training.loop import train
from prove_jax.training.preemption import PREEMPTED, Preempted
from tests.multihost import REPO, free_port, joining
from tests.train_helpers import tiny_config, write_config
from tests.xla_flags import xla_flags

pytestmark = pytest.mark.slow


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _max_param_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)))


def _saved_steps(run_dir):
    return sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit())


def test_sigterm_saves_the_next_step_and_the_relaunch_continues_exactly(tmp_path, monkeypatch):
    """One process: SIGTERM during step 2 saves step 3 (not a save_every step), restores the
    SIGTERM handler the run found, and the relaunch equals an uninterrupted run."""
    full = train(tiny_config(tmp_path, "full"), show_bar=False)

    class SignalledDuringStep2(trainer.MetricsLogger):
        def record(self, step, metrics):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().record(step, metrics)

    outside = []  # this test's own handler: a SIGTERM that reaches it was not the run's

    def ours(signum, frame):
        outside.append(signum)
    previous = signal.signal(signal.SIGTERM, ours)
    try:
        cfg = tiny_config(tmp_path, "preempted")  # steps=8, save_every=4
        monkeypatch.setattr(trainer, "MetricsLogger", SignalledDuringStep2)
        messages = []
        with pytest.raises(Preempted) as stopped:
            train(cfg, show_bar=False, log=messages.append)
        monkeypatch.undo()
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.step == 3 and outside == [] and restored is ours
    line = f"preempted: saved step 3 to {cfg.run_dir}; relaunch the same command to continue"
    assert line in messages, messages
    assert _saved_steps(cfg.run_dir) == [3]
    assert not os.path.exists(os.path.join(cfg.run_dir, "model"))  # not finished: no export

    again = train(cfg, show_bar=False)
    assert again.start_step == 3 and again.final_step == 8
    a, b = _losses(full.run_dir), _losses(again.run_dir)
    assert [s for s, _ in a] == list(range(1, 9)) == [s for s, _ in b]
    np.testing.assert_allclose([x for _, x in b], [x for _, x in a], rtol=1e-6, atol=0)
    assert _max_param_diff(again.state["params"], full.state["params"]) <= 1e-6


# The train CLI, paced: it prints "loop" as the step loop starts (then holds it HOLD_S
# seconds, when set) and "step N" after each logged step (then pauses PAUSE_S), so that a SIGTERM
# sent on seeing a line lands there (JAX's notifier looks for one once a second).
PACED_CLI = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
from prove_jax.cli.runner import run_cli
from prove_jax.cli.train import main
from prove_jax.training import loop

class Paced(loop.MetricsLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print("loop", flush=True)
        time.sleep(float(os.environ.get("HOLD_S", 0)))

    def record(self, step, metrics):
        rec = super().record(step, metrics)
        print(f"step {{step}}", flush=True)
        time.sleep({pause})
        return rec

loop.MetricsLogger = Paced
run_cli(main)
"""
PAUSE_S = 0.25
STOPPED = re.compile(r"preempted: saved step (\d+) to (\S+); relaunch the same command to continue")


# One interpreter per host that has imported the train CLI (seconds of jax, flax, optax and
# orbax imports, paid once instead of per launch); each launch is a child forked from it: a
# process of its own (pid, signals, exit code) whose JAX runtime starts in it, as none has
# started in the parent. It reads one launch per line, {"argv", "env", "out", "err"}, and
# answers the child's pid, then its exit code.
HOST = r"""
import json, os, runpy, sys, traceback
sys.path.insert(0, {repo!r})
from prove_jax.cli import runner, train  # noqa: F401
from prove_jax.training import loop  # noqa: F401
for line in sys.stdin:
    spec = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.update(spec["env"])
        for fd, path in ((1, spec["out"]), (2, spec["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv, code = spec["argv"], 0
        try:
            runpy.run_path(spec["argv"][0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _start_hosts(tmp_path) -> list[subprocess.Popen]:
    host = tmp_path / "host.py"
    host.write_text(HOST.format(repo=REPO))
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    hosts = [subprocess.Popen([sys.executable, str(host)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for host in hosts:  # its answers, read as they come
        host.answers = queue.Queue()
        threading.Thread(target=lambda h: [h.answers.put(int(x)) for x in h.stdout], args=(host,),
                         daemon=True).start()
    return hosts


def _answer(host: subprocess.Popen, timeout_s: float) -> int:
    """The host's next answer (a launch's pid or exit code)."""
    try:
        return host.answers.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no answer from a host in {timeout_s} s (host exit code {host.poll()})") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the host reaps its child at once: a finished launch is gone
        return True
    except ProcessLookupError:
        return False


def _wait_for_line(path: str, line: str, pids, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with open(path) as f:
            if line in f.read().splitlines():
                return
        if not all(map(_alive, pids)):
            break
        time.sleep(0.05)
    raise AssertionError(f"no {line!r} in {path} (running: {[_alive(p) for p in pids]})")


def _sigterm_host1(hosts, tmp_path, name: str, argv: list[str], wait_for: str, hold_s: float = 0) -> int:
    """Launch the paced CLI as two processes, send SIGTERM to process 1 alone once both printed
    `wait_for`; both must exit PREEMPTED, and host 0 alone says which step it saved (returned)."""
    cli = tmp_path / "paced_cli.py"
    cli.write_text(PACED_CLI.format(repo=REPO, pause=PAUSE_S))
    port = free_port()
    logs = [{k: str(tmp_path / f"{name}{i}.{k}") for k in ("out", "err")} for i in range(2)]
    for path in (p for log in logs for p in log.values()):
        open(path, "w").close()  # there before the launch writes to it
    for i, host in enumerate(hosts):
        host.stdin.write(json.dumps({"argv": [str(cli), *argv, *joining(i, port)], "env": {"HOLD_S": str(hold_s)},
                                     **logs[i]}) + "\n")
        host.stdin.flush()
    pids = [_answer(host, 240) for host in hosts]
    try:
        for i in range(2):
            _wait_for_line(logs[i]["out"], wait_for, pids, deadline_s=240)
        os.kill(pids[1], signal.SIGTERM)
        codes = [_answer(host, 120) for host in hosts]
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    err = [open(logs[i]["err"]).read() for i in range(2)]
    assert codes == [PREEMPTED, PREEMPTED], (codes, err[0][-2000:], err[1][-2000:])
    assert not STOPPED.search(err[1])  # host 0 reports
    found = STOPPED.findall(err[0])
    assert len(found) == 1, err[0][-2000:]
    return int(found[0][0]), found[0][1]


def test_sigterm_to_one_of_two_hosts_saves_the_same_step_on_both(tmp_path):
    """Two processes on loopback (one 8-device mesh), SIGTERM to host 1 alone: both hosts save
    the agreed step (each its shards and data state) and exit PREEMPTED, host 0 says so. A
    SIGTERM while the relaunch restores (before its first step) saves that first step. The
    run then ends at the losses and weights of an uninterrupted one-process run."""
    fields = dict(steps=20, save_every=20, log_every=1, mesh=[1, 4, 2], global_batch_size=8)
    cfg_path = write_config(tmp_path, "multi", **fields)
    run_dir = str(tmp_path / "multi")
    argv = ["--config", cfg_path, "--no-progress"]

    hosts = _start_hosts(tmp_path)
    try:
        step, where = _sigterm_host1(hosts, tmp_path, "first", argv, wait_for="step 3")
        assert where == run_dir and 3 < step < 19 and _saved_steps(run_dir) == [step]
        data_dir = os.path.join(run_dir, "checkpoints", str(step), "data")
        assert sorted(n for n in os.listdir(data_dir) if n.endswith(".json")) == [
            "process_0-of-2.json", "process_1-of-2.json"]

        # the notice comes before the loop: JAX's manager agreed on step 1, long passed
        early, _ = _sigterm_host1(hosts, tmp_path, "early", argv, wait_for="loop", hold_s=3)
        assert early == step + 1 and _saved_steps(run_dir) == [step, step + 1]
    finally:
        for host in hosts:
            host.stdin.close()
            try:
                host.wait(timeout=30)
            except subprocess.TimeoutExpired:
                host.kill()

    # the rest on one process, 8 local devices (a resume may change the host count): the
    # two-host continuation is checked above, by the losses of the early relaunch's step
    rest = train(load_config(cfg_path), show_bar=False)
    assert rest.start_step == step + 1 and rest.final_step == 20
    single = train(load_config(write_config(tmp_path, "single", **fields)), show_bar=False)
    multi = _losses(run_dir)
    assert [s for s, _ in multi] == list(range(1, 21))
    np.testing.assert_allclose([x for _, x in multi], [r["loss"] for r in single.records], rtol=1e-5)
    assert _max_param_diff(rest.state["params"], single.state["params"]) < 2e-5
