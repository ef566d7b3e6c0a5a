"""Pod start-up decisions against fake environments: JAX's own cluster classes (TPU VM metadata,
GKE, Slurm) read the faked metadata server and variables; `jax.distributed.initialize` is
replaced by a recorder bound to its real signature, so nothing is started."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest
from jax._src.clusters import ClusterEnv, cloud_tpu_cluster

from prove_jax import distributed

TPU_VARS = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID", "MEGASCALE_COORDINATOR_ADDRESS",
            "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "TPU_SKIP_MDS_QUERY", "SLURM_JOB_ID",
            "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri",
            "KUBERNETES_SERVICE_HOST")


@pytest.fixture
def joined(monkeypatch):
    sig = inspect.signature(jax.distributed.initialize)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda *a, **k: calls.append(dict(sig.bind(*a, **k).arguments)))
    for var in TPU_VARS:
        monkeypatch.delenv(var, raising=False)
    return calls


def _tpu_vm(monkeypatch, worker: int, endpoints: list[str]):
    """A Cloud TPU VM as `gcloud compute tpus tpu-vm ssh --worker=all` leaves it: no TPU variable
    set, the slice's workers known to the metadata server only."""
    metadata = {"agent-worker-number": str(worker), "worker-network-endpoints": ",".join(endpoints)}
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata",
                        lambda key: (metadata[key], 200) if key in metadata else ("", 404))


def test_a_tpu_vm_slice_started_by_gcloud_ssh_joins_by_jax_detection(joined, monkeypatch):
    _tpu_vm(monkeypatch, 1, ["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"])
    assert distributed.detect_cluster() == distributed.Cluster("gcetpu", 4)
    assert distributed.initialize(heartbeat_timeout_s=30) is True
    # no coordinator, count or id passed: JAX fills them in from the same metadata
    assert joined == [{"heartbeat_timeout_seconds": 30}]
    monkeypatch.setattr(cloud_tpu_cluster.BaseTpuCluster, "wait_for_coordinator", classmethod(lambda *a: None))
    assert ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)[:3] == \
        (f"10.0.0.5:{cloud_tpu_cluster.coordinator_port}", 4, 1)


def test_a_single_host_tpu_vm_is_no_job(joined, monkeypatch):
    _tpu_vm(monkeypatch, 0, ["10.0.0.5"])
    assert distributed.detect_cluster() == distributed.Cluster("gcetpu", 1)
    assert distributed.initialize() is False and joined == []


def test_gke_variables_and_multislice_join(joined, monkeypatch):
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")  # GKE: no metadata server for the slice
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w-0.js,w-1.js")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    assert distributed.detect_cluster() == distributed.Cluster("gketpu", 4)
    assert distributed.initialize() is True and joined == [{}]


def test_slurm_with_several_tasks_joins_and_with_one_does_not(joined, monkeypatch):
    for var, value in (("SLURM_JOB_ID", "77"), ("SLURM_STEP_NODELIST", "gpu[1-2]"), ("SLURM_NTASKS", "1"),
                       ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")):
        monkeypatch.setenv(var, value)
    assert distributed.initialize() is False and joined == []
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert distributed.detect_cluster() == distributed.Cluster("slurm", 2)
    assert distributed.initialize() is True and joined == [{}]


def test_a_passed_coordinator_wins_over_detection(joined, monkeypatch):
    _tpu_vm(monkeypatch, 0, ["10.0.0.5", "10.0.0.6"])
    assert distributed.initialize("10.9.9.9:1234", 2, 1) is True
    assert joined == [{"coordinator_address": "10.9.9.9:1234", "num_processes": 2, "process_id": 1}]


def test_no_cluster_is_a_single_process_run(joined):
    assert distributed.detect_cluster() is None
    assert distributed.initialize() is False and joined == []


def test_detection_and_join_failures_are_one_line(monkeypatch, joined):
    _tpu_vm(monkeypatch, 0, ["a:b"])  # a malformed endpoint list (neither format JAX reads)
    with pytest.raises(distributed.DistributedError, match="gcetpu cluster detection failed") as e:
        distributed.initialize()
    assert "\n" not in str(e.value)

    def refuses(*a, **k):
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Id: PjRT_Client_Connect\nmore")
    monkeypatch.setattr(jax.distributed, "initialize", refuses)
    with pytest.raises(distributed.DistributedError) as e:
        distributed.initialize("10.0.0.1:1", 2, 0)
    assert str(e.value).startswith("could not join the multi-host job (coordinator 10.0.0.1:1, 2 "
                                   "processes): DEADLINE_EXCEEDED: Barrier timed out")
    assert "\n" not in str(e.value)


def _gathered(per_host: list[dict]):
    """What the all-gather returns on each host for these hosts' facts."""
    rows = np.stack([[distributed._digest(v) for v in f.values()] for f in per_host]).astype(np.int32)
    return lambda mine: rows


def test_hosts_that_disagree_are_named_and_a_differing_command_line_only_warns(capsys):
    facts = distributed.launch_facts(["train.yaml", "steps=10", "--process-id", "0", "--coordinator", "h:1"])
    assert facts["command line"] == "train.yaml steps=10 --coordinator h:1"
    other = dict(facts, **{"local device count": str(jax.local_device_count() + 1)})
    with pytest.raises(distributed.DistributedError,
                       match=r"launched differently: local device count differs on hosts 1, 3 from host 0"):
        distributed.check_hosts_agree(facts, gather=_gathered([facts, other, facts, other]))
    paths = dict(facts, **{"command line": "train.yaml steps=10 run_dir=/mnt/other"})
    distributed.check_hosts_agree(facts, gather=_gathered([facts, paths]))  # no error
    assert "warning: the hosts run different command lines (command line differs on host 1 from host 0's" in capsys.readouterr().err
    distributed.check_hosts_agree(facts, gather=_gathered([facts, facts]))
    assert capsys.readouterr().err == ""
