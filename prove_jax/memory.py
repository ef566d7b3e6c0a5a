"""Does a compiled program fit in device memory? Checked before it runs.

XLA reports a compiled program's memory per device before anything is allocated, so a program
that cannot fit is refused with the sizes and what to lower, instead of an allocator error
inside the run (GPU/TPU) or the kernel's OOM killer (CPU).
"""

from __future__ import annotations

import os
from typing import Sequence

import jax


def free_device_memory(device) -> int | None:
    """Bytes free on `device`: its allocator's limit minus what is in use (GPU, TPU), or the
    host's available memory (CPU, whose simulated devices all share it); None if unknown (an
    accelerator without allocator stats: host RAM says nothing about its memory)."""
    if device.platform != "cpu":
        stats = device.memory_stats()
        if not stats or not stats.get("bytes_limit"):
            return None
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def program_memory(compiled, with_arguments: bool = False) -> int:
    """Bytes per device a compiled program allocates beyond its arguments (resident already), or
    in all with `with_arguments` (for a program whose inputs are not yet allocated)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return 0
    unaliased = int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
    extra = int(ma.temp_size_in_bytes) + max(0, unaliased)
    return extra + (int(ma.argument_size_in_bytes) if with_arguments else 0)


def check_fits(compiled, devices: Sequence, what: str, advice: str, error=MemoryError,
               with_arguments: bool = False) -> None:
    """Raise `error` ("{what} needs X GiB, but ... has Y GiB free: {advice}") when `compiled`
    needs more memory than `devices` have free; nothing when the free memory is unknown."""
    need = program_memory(compiled, with_arguments)
    device = devices[0]
    free = free_device_memory(device)
    if free is None or need == 0:
        return
    if device.platform == "cpu":  # simulated CPU devices share the host's memory
        need *= len(devices)
    if need > free:
        where = "the host" if device.platform == "cpu" else f"each {device.device_kind}"
        raise error(f"{what} needs {need / 2**30:.2f} GiB, but {where} has {free / 2**30:.2f} GiB "
                    f"free: {advice}")


def local_devices(mesh) -> list:
    """The devices of this process a program runs on: its mesh's, or the default device."""
    if mesh is None:
        return [jax.devices()[0]]
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
