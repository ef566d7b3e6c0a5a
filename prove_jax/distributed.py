"""Multi-host start-up: `jax.distributed.initialize` before any other JAX call.

On a TPU pod slice JAX discovers the coordinator and process ids itself (from the TPU VM's
metadata server, or GKE's TPU_WORKER_HOSTNAMES / TPU_WORKER_ID; Slurm and Open MPI likewise),
so a bare `initialize()` is right there, and JAX's own cluster detection decides whether this
launch is one process of several. Elsewhere (plain GPU machines, CPU tests on loopback) the
coordinator address, process count and process id are given explicitly. See docs/launch.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import warnings

import flax
import jax
import numpy as np
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from prove_jax.errors import ProveJaxError


class DistributedError(ProveJaxError, ValueError):
    """Inconsistent multi-host launch arguments."""


def _on_tpu_pod() -> bool:
    """Multi-host TPU slice by its environment alone: the runtime lists every host (or a
    multislice coordinator)."""
    hosts = (os.environ.get("TPU_WORKER_HOSTNAMES", "")
             or os.environ.get("TPU_PROCESS_ADDRESSES", ""))
    return "," in hosts or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What JAX's cluster detection found: its name for the environment and the process count."""
    name: str
    num_processes: int


def _cluster_types() -> list:
    """JAX's cluster environments (TPU VM metadata, GKE TPU, Slurm, Open MPI, Kubernetes), in the
    order its `initialize()` tries them; the opt-in ones (mpi4py) left out, as it does."""
    try:
        from jax._src.clusters import ClusterEnv  # optional: a private module JAX may drop
    except ImportError:  # a JAX without the module: the environment check alone decides
        return []
    return [env for env in ClusterEnv._cluster_types
            if not getattr(env, "opt_in_only_method", False)]


def detect_cluster() -> Cluster | None:
    """The multi-process environment JAX's own `initialize()` would join, or None. On a TPU VM
    this asks the metadata server (as JAX does), so the pod is found also where the launch
    sets no variable (`gcloud compute tpus tpu-vm ssh --worker=all`)."""
    for env in _cluster_types():
        try:
            with warnings.catch_warnings():  # Kubernetes without its client package warns
                warnings.simplefilter("ignore")
                if env.is_env_present():
                    return Cluster(env.name, int(env.get_process_count()))
        except Exception as e:  # noqa: BLE001 - a half-configured environment, named below
            raise DistributedError(f"JAX's {getattr(env, 'name', env.__name__)} cluster detection "
                                   f"failed: {type(e).__name__}: {e}; pass --coordinator, "
                                   f"--num-processes and --process-id instead") from None
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int | None = None,
               init_timeout_s: int | None = None) -> bool:
    """Join the multi-process job if this launch is one; returns True when it did.

    Explicit arguments win; with none, JAX's cluster detection (`detect_cluster`: a TPU pod
    slice, GKE, Slurm, ...) decides, and a launch it finds of several processes joins with JAX
    filling in every parameter; otherwise this is a single-process run and nothing happens.
    """
    explicit = [a is not None for a in (coordinator, num_processes, process_id)]
    if any(explicit) and not all(explicit):
        raise DistributedError("--coordinator, --num-processes and --process-id go together")
    kwargs = {}
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
    if init_timeout_s is not None:
        kwargs["initialization_timeout"] = int(init_timeout_s)
    if all(explicit):
        if not 0 <= process_id < num_processes:
            raise DistributedError(f"--process-id {process_id} outside [0, {num_processes})")
        if num_processes == 1:
            return False
        _join(f"coordinator {coordinator}, {num_processes} processes",
              coordinator, num_processes, process_id, **kwargs)
        return True
    if _on_tpu_pod():
        _join("JAX's TPU pod detection", **kwargs)
        return True
    cluster = detect_cluster()
    if cluster is not None and cluster.num_processes > 1:
        _join(f"JAX's {cluster.name} detection, {cluster.num_processes} processes", **kwargs)
        return True
    return False


_how_joined: str | None = None  # how this process joined its job (compared across hosts)


def _join(how: str, *args, **kwargs) -> None:
    """jax.distributed.initialize, its failure (a host that never came, a coordinator that does
    not answer: usually hosts launched differently) one line naming how this host joined."""
    global _how_joined
    try:
        jax.distributed.initialize(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistributedError(f"could not join the multi-host job ({how}): {first}; every host "
                               f"must be started with the same command and launch options, within "
                               f"the initialization timeout") from None
    _how_joined = how


# The process id is the one launch option that differs between hosts by design.
PER_HOST_OPTIONS = ("--process-id",)

# Launch facts compared across hosts that only warn: a command line may differ where a host's
# own paths do (a local disk mounted elsewhere); a setting that matters fails where it is used.
ADVISORY_FACTS = ("command line",)


def launch_facts(argv: list[str] | None = None) -> dict[str, str]:
    """{fact: value} that must be the same on every host: how it joined (coordinator and
    process count, or JAX's detection), its program, the local device count, the versions of
    JAX and Flax; and the command line less the per-host options (`ADVISORY_FACTS`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in PER_HOST_OPTIONS:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in PER_HOST_OPTIONS)):
            kept.append(a)
    return {"launch": str(_how_joined), "program": os.path.basename(sys.argv[0]),
            "local device count": str(jax.local_device_count()),
            "jax version": jax.__version__, "flax version": flax.__version__,
            "command line": " ".join(kept)}


def _digest(value: str) -> int:
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:4], "little") & 0x7FFFFFFF


def disagreements(facts: list[str], gathered: np.ndarray) -> list[str]:
    """'FACT differs on hosts 1, 3' for each fact whose digest (column) differs from host 0's
    (row 0)."""
    out = []
    for j, fact in enumerate(facts):
        hosts = [i for i in range(1, gathered.shape[0]) if gathered[i, j] != gathered[0, j]]
        if hosts:
            out.append(f"{fact} differs on host{'s' if len(hosts) > 1 else ''} "
                       f"{', '.join(map(str, hosts))}")
    return out


# How long a host waits for the others' launch facts: they all post them right after joining.
FACTS_TIMEOUT_S = 120
_checks = itertools.count()


def _gather_through_coordinator(mine: np.ndarray) -> np.ndarray:
    """Every host's row, through the coordination service's key-value store rather than an XLA
    collective: a first collective sets up the CPU backend's gloo context, after which a host
    that fails later leaves the others waiting in a collective with no time limit (before it,
    they stop when setting it up times out; tests/decoding/test_decode_multihost.py)."""
    client = jax_distributed.global_state.client
    # a fresh key per check (every host checks as often, in the same order): a host that reads
    # while another posts its next check's facts must not get those
    prefix = f"prove_jax/launch_facts/{next(_checks)}"
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine.tolist()))
    rows = []
    for i in range(jax.process_count()):
        try:
            rows.append(json.loads(client.blocking_key_value_get(f"{prefix}/{i}",
                                                                 FACTS_TIMEOUT_S * 1000)))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own error type
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DistributedError(f"host {i} did not post its launch settings within "
                                   f"{FACTS_TIMEOUT_S}s of joining ({first}); see its log"
                                   ) from None
    return np.asarray(rows, np.int64)


def check_hosts_agree(facts: dict[str, str], gather=None) -> None:
    """Raise on every host (none is left waiting in a later collective) when a host's `facts`
    differ from host 0's, naming the facts and hosts; `ADVISORY_FACTS` that differ are a
    warning from host 0. Nothing on one process. `gather` (tests): the all-gather of the
    digests, (processes, facts)."""
    if gather is None:
        if jax.process_count() == 1:
            return
        gather = _gather_through_coordinator
    gathered = gather(np.asarray([_digest(v) for v in facts.values()], np.int64))
    differ = disagreements(list(facts), gathered)
    hard = [d for d in differ if not d.startswith(ADVISORY_FACTS)]
    if hard:
        ours = "; ".join(f"{k}: {v}" for k, v in facts.items() if k not in ADVISORY_FACTS)
        raise DistributedError(f"the hosts were launched differently: {'; '.join(hard)} from host "
                               f"0 (host {jax.process_index()} has {ours}); start every host with "
                               f"the same command")
    if differ and is_main_process():
        print(f"warning: the hosts run different command lines ({'; '.join(differ)} from host "
              f"0's: {facts[ADVISORY_FACTS[0]]})", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-host launch options of every command that runs on a pod (train, generate)."""
    parser.add_argument("--coordinator", default=None,
                        help="multi-host: coordinator address HOST:PORT (process 0 listens there)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="multi-host: total process count")
    parser.add_argument("--process-id", type=int, default=None,
                        help="multi-host: this process's index")
    parser.add_argument("--heartbeat-timeout", type=int, default=None,
                        help="multi-host: seconds before a silent peer is declared dead (JAX "
                             "default 100)")


def initialize_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> bool:
    """`initialize` with the options of `add_arguments`; a launch that joined then checks that
    every host runs the same command (`argv`, default sys.argv) on as many devices."""
    joined = initialize(args.coordinator, args.num_processes, args.process_id,
                        heartbeat_timeout_s=args.heartbeat_timeout)
    if joined:
        check_hosts_agree(launch_facts(argv))
    return joined


def is_main_process() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (`name` must be the same on all); nothing on one."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
