"""Training writes TensorBoard event files beside metrics.jsonl, read back here with
TensorBoard's own reader (`EventAccumulator`, the `tensorboard` package: not our writer)."""

from __future__ import annotations

import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from prove_jax.training import metrics
from prove_jax.training.loop import train
from tests.train_helpers import tiny_config


def _events(logdir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run stopped after step 3 (its checkpoint at 2: save_every=2) and resumed to step 6:
    the relaunch redoes step 3."""
    tmp = tmp_path_factory.mktemp("tb")
    cfg = tiny_config(tmp, steps=6, save_every=2, max_length=16, global_batch_size=4,
                      optimizer={"lr": 1e-2, "warmup_ratio": 0.5, "min_lr_ratio": 0.1})
    train(cfg, show_bar=False, stop_after=3)
    # stop_after saves the step it stops at: drop it, as if the job had died after logging it
    import shutil
    shutil.rmtree(os.path.join(cfg.run_dir, "checkpoints", "3"))
    result = train(cfg, show_bar=False)
    return cfg, result


def test_event_files_hold_every_logged_scalar_once(resumed_run):
    cfg, result = resumed_run
    assert result.start_step == 2
    events = _events(os.path.join(cfg.run_dir, metrics.TENSORBOARD_DIR))
    records = _records(cfg.run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    for tag in ("train/loss", "train/learning_rate", "perf/tokens_per_s", "perf/step_time_s",
                "goodput/goodput", "goodput/compile_s", "goodput/checkpoint_s",
                "goodput/data_wait_s", "goodput/productive_s", "goodput/wall_s"):
        # the first launch's step 3 purged by the relaunch: each step once, in order
        assert [s for s, _ in events[tag]] == list(range(1, 7)), tag
    for key, tag in (("loss", "train/loss"), ("learning_rate", "train/learning_rate"),
                     ("tokens_per_s", "perf/tokens_per_s"), ("goodput", "goodput/goodput"),
                     ("checkpoint_s", "goodput/checkpoint_s")):
        assert [v for _, v in events[tag]] == pytest.approx([r[key] for r in records], rel=1e-6), tag


def test_learning_rate_is_the_rate_each_step_used(resumed_run):
    """Warmup over half of 6 steps starts at lr / 3 and peaks at lr (optimizer.py's schedule),
    then decays towards min_lr_ratio x lr."""
    cfg, _ = resumed_run
    lrs = [v for _, v in _events(os.path.join(cfg.run_dir, metrics.TENSORBOARD_DIR))["train/learning_rate"]]
    assert lrs[0] == pytest.approx(1e-2 / 3)
    assert lrs[3] == pytest.approx(1e-2)
    assert lrs[3] > lrs[4] > lrs[5] > 1e-3


def test_goodput_accounts_for_the_whole_launch(resumed_run):
    cfg, _ = resumed_run
    last = _records(cfg.run_dir)[-1]
    parts = (last["productive_s"] + last["compile_s"] + last["checkpoint_s"] + last["data_wait_s"]
             + last["startup_s"])
    assert parts == pytest.approx(last["wall_s"], rel=1e-9)
    assert 0 < last["goodput"] < 1
    assert last["goodput"] == pytest.approx(last["productive_s"] / last["wall_s"])
    # the relaunch compiled its step and restored a checkpoint before step 3
    assert last["compile_s"] > 0 and last["checkpoint_s"] > 0 and last["data_wait_s"] > 0


def test_goodput_clock_counts_loop_time_less_what_is_timed_inside_it():
    """Productive time is the loop's time after `begin_steps`, less what is timed inside it
    (data, checkpoints)."""
    now = [0.0]
    g = metrics.Goodput(clock=lambda: now[0])
    with g.timing("compile"):
        now[0] = 5.0
    now[0] = 6.0  # start-up
    g.begin_steps()
    with g.timing("data_wait"):
        now[0] = 7.0
    now[0] = 10.0  # a step
    with g.timing("checkpoint"):
        now[0] = 12.0
    g.end_steps()
    now[0] = 20.0  # after the loop
    s = g.summary()
    assert s == {"goodput": 3.0 / 20.0, "wall_s": 20.0, "productive_s": 3.0, "compile_s": 5.0,
                 "checkpoint_s": 2.0, "data_wait_s": 1.0, "startup_s": 9.0}


def test_benchmark_records_become_scalars_per_setting_and_batch_size(tmp_path):
    """`prove-jax benchmark --tensorboard DIR`: a chart per figure, a line per setting, the batch
    size as the step; missing figures (a peer's speedup) are left out."""
    from prove_jax.cli.benchmark import write_tensorboard
    records = [{"mode": "ar", "setting": "-", "batch_size": b, "tokens_per_second": 10.0 * b,
                "tokens_per_forward": 1.0, "speedup_vs_ar": 1.0, "accuracy": None} for b in (1, 4)]
    records.append({"mode": "lossless", "setting": "K=6,G=2", "batch_size": 1, "tokens_per_second": 21.0,
                    "tokens_per_forward": 4.5, "speedup_vs_ar": 2.1, "accuracy": 0.5})
    write_tensorboard(records, str(tmp_path / "tb"))
    events = _events(str(tmp_path / "tb"))
    assert events["tokens_per_second/ar"] == [(1, 10.0), (4, 40.0)]
    assert events["speedup_vs_ar/lossless_K_6_G_2"] == [(1, pytest.approx(2.1))]
    assert events["accuracy/lossless_K_6_G_2"] == [(1, 0.5)] and "accuracy/ar" not in events
