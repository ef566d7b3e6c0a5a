"""Preemption: a SIGTERM during the steps saves one step on every host, the run stops with
PREEMPTED and a line saying what to do, and the relaunch continues exactly: its losses and
final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

from prove_jax.training import loop as trainer
from prove_jax.training.config import load_config
from prove_jax.training.loop import train
from prove_jax.training.preemption import PREEMPTED, Preempted
from tests.multihost import REPO, HostPool, free_port, host_env, joining
from tests.train_helpers import tiny_config, write_config

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the host reaps its child at once: a finished launch is gone
        return True
    except ProcessLookupError:
        return False


def _wait_for_line(path: str, line: str, pids, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if os.path.exists(path):  # the forked launch opens its log as it starts
            with open(path) as f:
                if line in f.read().splitlines():
                    return
        if not all(map(_alive, pids)):
            break
        time.sleep(0.05)
    raise AssertionError(f"no {line!r} in {path} (running: {[_alive(p) for p in pids]})")


def _sigterm_host1(tmp_path, name: str, argv: list[str], wait_for: str, hold_s: float = 0) -> int:
    """Launch the paced CLI as two processes (each forked from the pre-warmed host interpreter,
    `multihost.HostPool`: a process of its own, pid, signals and exit code), send SIGTERM to
    process 1 alone once both printed `wait_for`; both must exit PREEMPTED, and host 0 alone
    says which step it saved (returned)."""
    cli = tmp_path / f"paced_cli_{name}.py"
    cli.write_text(PACED_CLI.format(repo=REPO, pause=PAUSE_S))
    port = free_port()
    env = dict(host_env(), HOLD_S=str(hold_s))
    procs = [HostPool.shared().launch([str(cli), *argv, *joining(i, port)], env) for i in range(2)]
    pids = [p.pid for p in procs]
    try:
        for p in procs:
            _wait_for_line(p.log + ".out", wait_for, pids, deadline_s=240)
        os.kill(pids[1], signal.SIGTERM)
        err = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None and _alive(p.pid):
                os.kill(p.pid, signal.SIGKILL)
    codes = [p.returncode for p in procs]
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

    step, where = _sigterm_host1(tmp_path, "first", argv, wait_for="step 3")
    assert where == run_dir and 3 < step < 19 and _saved_steps(run_dir) == [step]
    data_dir = os.path.join(run_dir, "checkpoints", str(step), "data")
    assert sorted(n for n in os.listdir(data_dir) if n.endswith(".json")) == [
        "process_0-of-2.json", "process_1-of-2.json"]

    # the notice comes before the loop: JAX's manager agreed on step 1, long passed
    early, _ = _sigterm_host1(tmp_path, "early", argv, wait_for="loop", hold_s=3)
    assert early == step + 1 and _saved_steps(run_dir) == [step, step + 1]

    # the rest on one process, 8 local devices (a resume may change the host count): the
    # two-host continuation is checked above, by the losses of the early relaunch's step
    rest = train(load_config(cfg_path), show_bar=False)
    assert rest.start_step == step + 1 and rest.final_step == 20
    single = train(load_config(write_config(tmp_path, "single", **fields)), show_bar=False)
    multi = _losses(run_dir)
    assert [s for s, _ in multi] == list(range(1, 21))
    np.testing.assert_allclose([x for _, x in multi], [r["loss"] for r in single.records], rtol=1e-5)
    assert _max_param_diff(rest.state["params"], single.state["params"]) < 2e-5
