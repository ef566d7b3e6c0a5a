"""Multi-host: two processes on loopback, 4 simulated CPU devices each, one 8-device mesh.

Each process joins with jax.distributed, reads its own half of every global batch, trains two
steps, saves (every host writes its shards), stops, resumes from the checkpoint and trains two
more, then exports the model. The losses and final weights must equal a single-process run on
8 local devices with the same global batches. The commit head trained by the train CLI on the
same two hosts must equal a one-device run's.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from prove_jax.checkpoints import checkpoint
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.checkpoints.commit_head_io import load_commit_head
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import create_model
from prove_jax.training.commit_head_training import train_commit_head
from prove_jax.training.config import load_config
from prove_jax.training.loop import train
from tests.multihost import REPO, CommandsJob
from tests.train_helpers import write_config, write_text, write_tokenizer

pytestmark = pytest.mark.slow

# Both tests' runs are one two-process job (tests/multihost.CommandsJob: one launch): the
# commit-head train CLI joins it, then this script trains the proposer in the same processes.
WORKER = r"""
import json, sys
cfg_path, out = sys.argv[1], sys.argv[2]
import jax
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
from prove_jax.training.config import load_config
from prove_jax.training.loop import train
cfg = load_config(cfg_path)
first = train(cfg, show_bar=False, stop_after=2)
second = train(cfg, show_bar=False)
with open(out + f"-{jax.process_index()}.json", "w") as f:
    json.dump({"first_final": first.final_step, "second_start": second.start_step,
               "losses": [r["loss"] for r in first.records + second.records]}, f)
"""

FIELDS = dict(steps=4, save_every=2, log_every=1, mesh=[1, 4, 2], global_batch_size=8)
HEAD_CFG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mask_token_id=299, eos_token_ids=(0,), pad_token_id=0)


def _head_args(folder) -> list[str]:
    """The commit-head run's config overrides (its proposer and verifier saved in FOLDER)."""
    tok = write_tokenizer(folder)
    return ["objective=commit_head", f"proposer={folder / 'p'}", f"model.checkpoint={folder / 'v'}",
            f"data={write_text(folder)}", f"tokenizer.path={tok}", "tokenizer.bpe_vocab_size=null",
            "steps=3", "log_every=1", "max_length=32", "block_size=4", "global_batch_size=8",
            "optimizer.lr=1e-2"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(mars folder, head folder, the job): started with the module, waited for by the tests."""
    mars, head = tmp_path_factory.mktemp("mars"), tmp_path_factory.mktemp("head")
    multi_cfg = write_config(mars, "multi", **FIELDS)
    worker = mars / "worker.py"
    worker.write_text(WORKER)
    tok = write_tokenizer(head)
    save_model(str(head / "p"), create_model(HEAD_CFG, seed=11), tokenizer_dir=tok)
    save_model(str(head / "v"), create_model(HEAD_CFG.replace(hidden_size=16, num_heads=2, num_kv_heads=1),
                                             seed=12), tokenizer_dir=tok)
    logs = tmp_path_factory.mktemp("job")
    job = CommandsJob([
        ["train.train", "--config", os.path.join(REPO, "configs", "tiny.yaml"), *_head_args(head),
         "mesh=[1,4,2]", f"run_dir={head / 'multi'}"],
        [str(worker), multi_cfg, str(mars / "result")]], logs)
    yield mars, head, job
    job.stop()


def test_two_processes_match_single_process(job):
    tmp_path, _, two_hosts = job
    out = str(tmp_path / "result")
    single = train(load_config(write_config(tmp_path, "single", **FIELDS)), show_bar=False)
    two_hosts.results()
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


def test_commit_head_trains_on_two_hosts_like_on_one(job):
    """objective=commit_head from the train CLI on two processes (mesh fsdp=4 x tensor=2 over
    both): the frozen proposer and verifier are read sharded, each host feeds its half of the
    batch, and the losses and the exported head equal a one-device run's."""
    _, tmp_path, two_hosts = job
    common = _head_args(tmp_path)
    single = train_commit_head(load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                                           common + ["mesh=[1,1,1]", f"run_dir={tmp_path / 'single'}"]),
                               show_bar=False)
    hosts = two_hosts.results()[0]
    assert "commit head step 3/3" in hosts[0].stderr and "commit head step" not in hosts[1].stderr  # host 0 reports
    multi = [json.loads(x) for x in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in multi] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in multi], [r["loss"] for r in single["records"]], rtol=1e-5)
    heads = [nnx.state(load_commit_head(str(tmp_path / run / "model")), nnx.Param) for run in ("multi", "single")]
    for a, b in zip(jax.tree.leaves(heads[0]), jax.tree.leaves(heads[1])):
        # Adam divides by the root of tiny second moments: float noise of the sharded sums
        # shows in a few weights at 1e-5 after three steps
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    assert checkpoint.load_config(str(tmp_path / "multi" / "model")).hidden_size == 16  # the verifier
