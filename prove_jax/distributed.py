"""Multi-host start-up: `jax.distributed.initialize` before any other JAX call.

On a TPU pod slice JAX discovers the coordinator and process ids from the TPU metadata, so a
bare `initialize()` is right; elsewhere (GPU clusters, CPU tests on loopback) the coordinator
address, process count and process id are given explicitly.
"""

from __future__ import annotations

import argparse
import os

import jax

from prove_jax.errors import ProveJaxError


class DistributedError(ProveJaxError, ValueError):
    """Inconsistent multi-host launch arguments."""


def _on_tpu_pod() -> bool:
    """Multi-host TPU slice: the runtime lists every host (or a multislice coordinator)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int | None = None,
               init_timeout_s: int | None = None) -> bool:
    """Join the multi-process job if this launch is one; returns True when it did.

    Explicit arguments win; with none, a multi-host TPU slice is detected from the environment;
    otherwise this is a single-process run and nothing happens.
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
        jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)
        return True
    if _on_tpu_pod():
        jax.distributed.initialize(**kwargs)
        return True
    return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-host launch options of every command that runs on a pod (train, generate)."""
    parser.add_argument("--coordinator", default=None,
                        help="multi-host: coordinator address HOST:PORT (process 0 listens there)")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: total process count")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    parser.add_argument("--heartbeat-timeout", type=int, default=None,
                        help="multi-host: seconds before a silent peer is declared dead (JAX default 100)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """`initialize` with the options of `add_arguments`."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      heartbeat_timeout_s=args.heartbeat_timeout)


def is_main_process() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (`name` must be the same on all); nothing on one."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
