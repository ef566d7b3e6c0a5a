"""A run's device mesh (`mesh` in the config), checked against its batch: every host must feed
its own distinct, equal share of each global batch."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import NamedSharding

from prove_jax.models import sharding
from prove_jax.training.config import TrainConfig, TrainConfigError
from prove_jax.training.host_log import log_main
from prove_jax.training.step import BATCH_SPEC


def check_hosts_split_the_batch(mesh, process_of=lambda d: d.process_index) -> None:
    """Each process feeds its own rows (`data.to_global_batch`), so the batch axes (data x fsdp)
    must give every process a distinct, equal share of the rows. A mesh whose hosts differ only
    along the tensor axis would make them hold different rows for one replicated shard:
    silently wrong batches, so it is refused."""
    processes = sorted({process_of(d) for d in mesh.devices.flat})
    if len(processes) == 1:
        return
    shards = sharding.batch_shards(mesh)  # one row each below
    owned: dict[int, set] = {p: set() for p in processes}
    for device, index in NamedSharding(mesh, BATCH_SPEC).devices_indices_map((shards,)).items():
        owned[process_of(device)].add(index[0].indices(shards)[:2])
    shared = any(owned[a] & owned[b] for i, a in enumerate(processes) for b in processes[i + 1:])
    if shared or len({len(v) for v in owned.values()}) != 1:
        raise TrainConfigError(
            f"mesh {dict(mesh.shape)} does not split the batch across the {len(processes)} "
            f"processes: each host feeds its own rows, so the batch axes data x fsdp = {shards} "
            f"must run across the hosts (put the hosts on data or fsdp, the tensor axis within a "
            f"host)")


def config_mesh(cfg: TrainConfig, log: Callable[[str], None] = log_main):
    """The run's device mesh (`mesh` in the config), checked against its batch and logged, or
    an error saying how to fit it here."""
    try:
        mesh = sharding.make_mesh(cfg.mesh)
    except sharding.MeshError as e:
        raise sharding.MeshError(f"{e}: set mesh=[data,fsdp,tensor] to this machine's devices "
                                 f"(--dry-run checks a pod's layout from here)") from None
    check_batch_layout(cfg, mesh)
    log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)")
    return mesh


def check_batch_layout(cfg: TrainConfig, mesh) -> None:
    check_hosts_split_the_batch(mesh)
    rows = sharding.batch_shards(mesh)
    micro = cfg.global_batch_size // cfg.optimizer.grad_accum
    if cfg.global_batch_size % jax.process_count():
        raise TrainConfigError(f"global_batch_size={cfg.global_batch_size} must be a multiple of "
                               f"the process count {jax.process_count()}")
    if micro % rows or (cfg.global_batch_size // rows) % cfg.optimizer.grad_accum:
        raise TrainConfigError(
            f"global_batch_size={cfg.global_batch_size} must be a multiple of data x fsdp = {rows} "
            f"times optimizer.grad_accum = {cfg.optimizer.grad_accum}")

