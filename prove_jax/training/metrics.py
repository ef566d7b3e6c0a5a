"""Training progress: a tqdm bar, RUN_DIR/metrics.jsonl (one JSON record per logged step) and
the same scalars as TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir`).

Throughput is counted in real tokens per second: the step's tokens without row padding (a
step's `real_tokens` metric; batch x length when a step has none), of the MARS clean stream only
(the masked copy is overhead of the objective, not data). MFU is shown when the accelerator's
peak is known: the model FLOPs of those real tokens (6 x matmul params per streamed token, 2x
for MARS, whose forward is over 2L positions, + attention) over step time x devices x peak.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from typing import Callable

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

from prove_jax import distributed, storage

# Dense bf16 peak FLOP/s per chip, matched on a substring of jax's device_kind.
PEAK_FLOPS = {
    "v5p": 459e12, "v5 lite": 197e12, "v5e": 197e12, "v6 lite": 918e12, "v6e": 918e12,
    "v4": 275e12, "h100": 989e12, "h200": 989e12, "a100": 312e12,
}


def peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for key, flops in PEAK_FLOPS.items():
        if key in kind:
            return flops
    return None


def matmul_params(model_cfg) -> int:
    """The N of 6N: parameters multiplied per token. The input embedding is a lookup, not a
    matmul, so it is left out; the LM head is a matmul, so with tied embeddings the one table
    counts once, as the head."""
    embedding = model_cfg.vocab_size * model_cfg.hidden_size
    return model_cfg.num_params - (0 if model_cfg.tie_word_embeddings else embedding)


def train_flops_per_step(model_cfg, batch: int, length: int, objective: str) -> float:
    """Forward + backward FLOPs of one step (matmuls only; attention over the full span)."""
    streamed = length * (2 if objective == "mars" else 1)
    matmul = 6.0 * matmul_params(model_cfg) * batch * streamed
    per_pair = 12.0 * model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim
    attn = per_pair * batch * streamed ** 2
    return matmul + attn


def _scalar(x) -> float:
    return float(np.asarray(x))


class Goodput:
    """Where a launch's wall time goes, from the moment this is made.

    `timing(kind)` adds the time of a block to one of `KINDS`; the step loop runs between
    `begin_steps()` and `end_steps()`, and its time less the kinds timed inside it is the
    productive step time. `summary()` may be called at any point.
    """

    KINDS = ("compile", "checkpoint", "data_wait")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.start = clock()
        self.spent = dict.fromkeys(self.KINDS, 0.0)
        self.productive = 0.0
        self._loop = None  # (clock, sum of spent) when the step loop began

    @contextlib.contextmanager
    def timing(self, kind: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.spent[kind] += self.clock() - t0

    def begin_steps(self) -> None:
        self._loop = (self.clock(), sum(self.spent.values()))

    def _in_loop(self, now: float) -> float:
        if self._loop is None:
            return 0.0
        t0, spent0 = self._loop
        return (now - t0) - (sum(self.spent.values()) - spent0)

    def end_steps(self) -> None:
        self.productive += self._in_loop(self.clock())
        self._loop = None

    def summary(self) -> dict:
        """{goodput, wall_s, productive_s, compile_s, checkpoint_s, data_wait_s, startup_s}."""
        now = self.clock()
        wall = now - self.start
        productive = self.productive + self._in_loop(now)
        out = {"goodput": productive / wall if wall > 0 else None, "wall_s": wall,
               "productive_s": productive}
        out.update({f"{k}_s": v for k, v in self.spent.items()})
        out["startup_s"] = wall - productive - sum(self.spent.values())
        return out


# TensorBoard tag of each record key (the group it is shown under); other numeric keys go
# under train/, and a list (accuracy by block position) as one scalar per position
TB_TAGS = {
    "loss": "train/loss", "learning_rate": "train/learning_rate",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
    "padding_fraction": "data/padding_fraction",
    "goodput": "goodput/goodput", "wall_s": "goodput/wall_s",
    "productive_s": "goodput/productive_s",
    "compile_s": "goodput/compile_s", "checkpoint_s": "goodput/checkpoint_s",
    "data_wait_s": "goodput/data_wait_s", "startup_s": "goodput/startup_s",
}

TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard: `tensorboard --logdir RUN_DIR/tensorboard`


def tensorboard_scalars(rec: dict) -> dict[str, float]:
    """{tag: value} of a metrics record's numeric entries (None and the step left out)."""
    out = {}
    for k, v in rec.items():
        if k == "step" or v is None:
            continue
        if isinstance(v, list):
            out.update({f"train/{k}/{i}": float(x) for i, x in enumerate(v)
                        if isinstance(x, (int, float))})
        elif isinstance(v, (int, float)):
            out[TB_TAGS.get(k, f"train/{k}")] = float(v)
    return out


class TensorBoardWriter:
    """Scalars as TensorBoard event files in `logdir` (tensorboardX: no TensorFlow needed).

    A relaunch that resumes at `start_step` marks the steps after it as purged, so TensorBoard
    shows the steps the restored run redoes once, as metrics.jsonl does. At a URL the events
    are written locally and the file uploaded whole every `FLUSH_S` and at the end (an object
    store cannot append)."""

    FLUSH_S = 30

    def __init__(self, logdir: str, start_step: int = 0):
        self.remote = logdir if storage.is_url(logdir) else None
        self.local = tempfile.mkdtemp(prefix="prove-jax-tb-") if self.remote else logdir
        self.writer = SummaryWriter(self.local, purge_step=start_step + 1 if start_step else None,
                                    flush_secs=self.FLUSH_S)
        self.uploaded = time.monotonic() if self.remote else None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        if self.remote and time.monotonic() - self.uploaded >= self.FLUSH_S:
            self._upload()

    def _upload(self) -> None:
        self.writer.flush()
        storage.makedirs(self.remote)
        storage.upload_dir(self.local, self.remote)
        self.uploaded = time.monotonic()

    def close(self) -> None:
        self.writer.close()
        if self.remote:
            self._upload()
            shutil.rmtree(self.local, ignore_errors=True)


METRICS_FILE = "metrics.jsonl"  # RUN_DIR/metrics.jsonl: one JSON record per logged step


class MetricsFile:
    """RUN_DIR/metrics.jsonl, the one writer of it (the train loop's and the commit head's
    records alike), on process 0 only; every process may call it (others are no-ops).

    `keep_through(step)` drops the records of later steps now (a resumed run redoes them);
    without it the first record replaces the file (a run that never resumes; one that fails
    before its first record leaves the last run's records as they were). At a URL the file is
    rewritten whole on every record (an object store cannot append)."""

    def __init__(self, run_dir: str):
        self.main = distributed.is_main_process()
        self.path = storage.join(run_dir, METRICS_FILE)
        self.lines: list[str] | None = [] if storage.is_url(run_dir) else None
        self.started = False  # a record was written, or the old ones were kept
        if self.main:
            storage.makedirs(run_dir)

    def keep_through(self, step: int) -> None:
        """On resume, forget records of steps that the restored checkpoint never reached."""
        self.started = True
        if not self.main or not storage.exists(self.path):
            return
        keep = [line + "\n" for line in storage.read_text(self.path).splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        if self.lines is not None:
            self.lines = keep
        storage.write_text(self.path, "".join(keep))

    def append(self, rec: dict) -> None:
        if not self.main:
            return
        line = json.dumps(rec) + "\n"
        if self.lines is not None:
            self.lines.append(line)
            storage.write_text(self.path, "".join(self.lines))
        else:
            with open(self.path, "a" if self.started else "w") as f:
                f.write(line)
        self.started = True


class MetricsLogger:
    """Writes jsonl and TensorBoard events on process 0 only; every process may call it (others
    are no-ops). `learning_rate` is the optimizer's schedule (the rate of step s is its value at
    s - 1, the update count before it); `goodput` the launch's `Goodput`."""

    def __init__(self, run_dir: str, total_steps: int, start_step: int = 0, flops_per_step=None,
                 tokens_per_step: int = 0, block_size: int | None = None, show_bar: bool = True,
                 learning_rate: Callable | None = None, goodput: Goodput | None = None,
                 tensorboard: bool = True):
        self.main = distributed.is_main_process()
        self.file = MetricsFile(run_dir)
        self.tokens_per_step = tokens_per_step
        self.block_size = block_size
        self.learning_rate = learning_rate
        self.goodput = goodput
        self.tb = None
        peak = peak_flops(jax.devices()[0].device_kind)
        self.peak_total = peak * jax.device_count() if peak else None
        self.flops_per_step = flops_per_step
        self.last_time, self.last_step = time.perf_counter(), start_step
        self.bar = None
        self.file.keep_through(start_step)
        if self.main:
            if tensorboard:
                self.tb = TensorBoardWriter(storage.join(run_dir, TENSORBOARD_DIR), start_step)
            if show_bar:
                self.bar = tqdm(total=total_steps, initial=start_step, desc="train",
                                dynamic_ncols=True)

    def record(self, step: int, metrics: dict) -> dict:
        """Log the metrics of the step that just finished (1-based `step`)."""
        now = time.perf_counter()
        steps_done = max(1, step - self.last_step)
        dt = (now - self.last_time) / steps_done
        self.last_time, self.last_step = now, step
        rec = {"step": step}
        for k, v in metrics.items():
            arr = np.asarray(v)
            rec[k] = arr.tolist() if arr.ndim else float(arr)
        rec["step_time_s"] = dt
        # real tokens of the step logged (padding is compute spent on nothing)
        real = rec.get("real_tokens", self.tokens_per_step)
        share = real / self.tokens_per_step if self.tokens_per_step else 1.0
        if "real_tokens" in rec and self.tokens_per_step:
            rec["padding_fraction"] = 1.0 - share
        rec["tokens_per_s"] = real / dt if dt > 0 else None
        if self.peak_total and self.flops_per_step:
            rec["mfu"] = self.flops_per_step * share / dt / self.peak_total
        if self.learning_rate is not None:
            rec["learning_rate"] = float(self.learning_rate(step - 1))
        if self.goodput is not None:
            rec.update(self.goodput.summary())
        self.file.append(rec)
        if self.main:
            if self.tb is not None:
                self.tb.write(step, tensorboard_scalars(rec))
            if self.bar is not None:
                self.bar.update(step - self.bar.n)
                self.bar.set_postfix_str(self.describe(rec), refresh=True)
        return rec

    def describe(self, rec: dict) -> str:
        parts = [f"loss {rec['loss']:.4f}"]
        if "loss_masked" in rec:
            parts.append(f"masked {rec['loss_masked']:.4f}")
        if "loss_clean" in rec:
            parts.append(f"clean {rec['loss_clean']:.4f}")
        acc = rec.get("masked_acc_by_pos")
        if acc:
            shown = acc[:4] + (["..", acc[-1]] if len(acc) > 5 else acc[4:])
            shown = [x if isinstance(x, str) else f"{x:.2f}" for x in shown]
            parts.append("acc@pos " + " ".join(shown))
        if rec.get("tokens_per_s"):
            parts.append(f"{rec['tokens_per_s']:.0f} tok/s")
        if rec.get("mfu") is not None:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        if rec.get("goodput") is not None:
            parts.append(f"goodput {100 * rec['goodput']:.0f}%")
        return ", ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
