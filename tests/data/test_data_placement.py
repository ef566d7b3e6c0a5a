"""Each host reads exactly the rows of each global batch that its own devices hold.

Two processes on loopback, 4 simulated CPU devices each, on a mesh whose device order is not
the process order: process 1's devices hold rows 0, 2, 4, 6 and process 0's rows 1, 3, 5, 7.
The global batches assembled from both hosts must equal a single process's, row for row; the
process-index share (host h feeds rows h*4..h*4+3) would put them in other places. The same
two processes check that hosts launched differently stop with the facts that differ.
"""

from __future__ import annotations

import json

import numpy as np

from prove_jax.data.pipeline import make_dataset
from tests.multihost import REPO, run_two_processes
from tests.tokenizers_fixture import make_tokenizer, stdlib_text

WORKER = r"""
import json, sys
sys.path.insert(0, {repo!r})
port, pid, text, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
from prove_jax import distributed
assert distributed.initialize(f"127.0.0.1:{{port}}", 2, pid, heartbeat_timeout_s=20, init_timeout_s=90)
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from prove_jax.data import pipeline
from prove_jax.models.sharding import make_mesh
from prove_jax.training.step import BATCH_SPEC
from tests.tokenizers_fixture import make_tokenizer

p0 = [d for d in jax.devices() if d.process_index == 0]
p1 = [d for d in jax.devices() if d.process_index == 1]
mesh = make_mesh((4, 2, 1), devices=[d for pair in zip(p1, p0) for d in pair])
sharding = NamedSharding(mesh, BATCH_SPEC)
rows = pipeline.host_rows(sharding, 8, 16)
kw = dict(max_length=16, block_size=4, global_batch_size=8, seed=3)
tok = make_tokenizer(300)
result = {{"rows": rows.tolist()}}
for name, host in (("placed", rows), ("by_process_index", None)):
    it = pipeline.make_dataset([{{"text": text}}], tok, rows=host, **kw)
    batches = []
    for _ in range(3):
        g = pipeline.to_global_batch(next(it), mesh, BATCH_SPEC)
        batches.append(np.asarray(multihost_utils.process_allgather(g["input_ids"], tiled=True)).tolist())
    result[name] = batches

facts = {{"local device count": str(jax.local_device_count()), "jax version": jax.__version__}}
distributed.check_hosts_agree(facts)  # the same on both: nothing
try:
    distributed.check_hosts_agree(dict(facts, program=f"prove-jax-{{pid}}"))
except distributed.DistributedError as e:
    result["disagree"] = str(e)
with open(out + f"-{{pid}}.json", "w") as f:
    json.dump(result, f)
"""


def test_hosts_read_the_rows_their_devices_hold(tmp_path):
    text = stdlib_text(("textwrap",))[:6000]
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(repo=REPO))
    out = str(tmp_path / "result")
    run_two_processes(lambda i, port: [str(worker), str(port), str(i), text, out])
    hosts = [json.loads(open(f"{out}-{i}.json").read()) for i in range(2)]

    it = make_dataset([{"text": text}], make_tokenizer(300), max_length=16, block_size=4,
                      global_batch_size=8, seed=3)  # one process: the whole global batch
    single = [next(it)["input_ids"].tolist() for _ in range(3)]
    assert hosts[0]["rows"] == [1, 3, 5, 7] and hosts[1]["rows"] == [0, 2, 4, 6]
    for host in hosts:
        assert host["placed"] == single
        # the contiguous process-index share lands the rows elsewhere (the test can tell)
        assert host["by_process_index"] != single
        assert sorted(map(tuple, np.concatenate(host["by_process_index"]).tolist())) == \
            sorted(map(tuple, np.concatenate(single).tolist()))
        assert host["disagree"].startswith("the hosts were launched differently: program differs on host 1 "
                                           "from host 0")
