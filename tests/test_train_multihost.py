"""Multi-host: two processes on loopback, 4 simulated CPU devices each, one 8-device mesh.

Each process joins with jax.distributed, reads its own half of every global batch, trains two
steps, saves (every host writes its shards), stops, resumes from the checkpoint and trains two
more, then exports the model. The losses and final weights must equal a single-process run on
8 local devices with the same global batches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

from prove_jax import checkpoint
from prove_jax.train_config import load_config
from prove_jax.trainer import train
from tests.train_helpers import write_config
from tests.xla_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, sys
sys.path.insert(0, {repo!r})
port, pid, cfg_path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
from prove_jax import distributed
assert distributed.initialize(f"127.0.0.1:{{port}}", 2, pid, heartbeat_timeout_s=20,
                              init_timeout_s=90)
import jax
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
from prove_jax.train_config import load_config
from prove_jax.trainer import train
cfg = load_config(cfg_path)
first = train(cfg, show_bar=False, stop_after=2)
second = train(cfg, show_bar=False)
with open(out + f"-{{pid}}.json", "w") as f:
    json.dump({{"first_final": first.final_step, "second_start": second.start_step,
               "losses": [r["loss"] for r in first.records + second.records]}}, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
    fields = dict(steps=4, save_every=2, log_every=1, mesh=[1, 4, 2], global_batch_size=8)
    multi_cfg = write_config(tmp_path, "multi", **fields)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(repo=REPO))
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices=4),
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port, out = _free_port(), str(tmp_path / "result")
    procs = [subprocess.Popen(["timeout", "300", sys.executable, str(worker), str(port), str(i),
                               multi_cfg, out], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=330)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    single = train(load_config(write_config(tmp_path, "single", **fields)), show_bar=False)
    single_losses = [r["loss"] for r in single.records]
    for i in range(2):
        with open(f"{out}-{i}.json") as f:
            res = json.load(f)
        assert res["first_final"] == 2 and res["second_start"] == 2  # stopped, then resumed
        np.testing.assert_allclose(res["losses"], single_losses, rtol=1e-5)

    # the checkpoint folder holds one data-iterator state per host
    data_dir = tmp_path / "multi" / "checkpoints" / "4" / "data"
    states = sorted(n for n in os.listdir(data_dir) if n.endswith(".json"))
    assert states == ["process_0-of-2.json", "process_1-of-2.json"]
    exported = checkpoint.load_model(str(tmp_path / "multi" / "model"))
    ours = checkpoint.params_pure_dict(exported)
    ref = jax.tree.map(np.asarray, single.state["params"])
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), ours, ref))
    assert max(diffs) < 2e-5
