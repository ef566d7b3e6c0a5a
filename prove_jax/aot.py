"""Ahead-of-time compile of a program for a real TPU topology, from a machine without TPUs.

With the optional `libtpu` package installed, `jax.experimental.topologies` describes a TPU
slice whose devices a `Mesh` can be laid on; a jitted step lowered with shardings on that mesh
compiles exactly as it would on the slice. The compiled program then reports per-chip memory
(arguments, temporaries, peak) and holds the collectives XLA's partitioner chose.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from prove_jax.errors import ProveJaxError

# Chips of a slice by topology: v4/v5p are 3D tori, v5e/v6e 2D (the shapes Cloud TPU offers).
_TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
                256: "16x16"}
TPU_TOPOLOGIES = {"v4": _TOPOLOGY_3D, "v5p": _TOPOLOGY_3D, "v5e": _TOPOLOGY_2D, "v6e": _TOPOLOGY_2D}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# `%name = TYPE[dims]{layout} all-gather(` or its async `all-gather-start(`; a tuple result
# `(bf16[..], bf16[..])` holds several shapes
_COLLECTIVE_LINE = re.compile(r"=\s*(?P<shapes>\(?[a-z0-9]+\[[^=]*?)\s+(?P<kind>" +
                              "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


GIB = 1024 ** 3
# Usable memory per chip as the runtime reports it (libtpu's figure for v6e is 31.25 GiB, not
# the 32 of the spec sheet; the GPUs' are the spec sheets').
CHIP_HBM_GIB = {"v5p": 95, "v5e": 16, "v4": 32, "v6e": 31.25, "H100": 80, "H200": 141}
# Per chip, from the Cloud TPU and NVIDIA spec sheets: HBM bandwidth in bytes/s and dense
# bf16 peak in FLOP/s (H100/H200: SXM). What `roofline_seconds` of a step report divides by.
CHIP_HBM_BANDWIDTH = {"v5p": 2765e9, "v5e": 819e9, "v4": 1200e9, "v6e": 1640e9, "H100": 3350e9,
                      "H200": 4800e9}
CHIP_PEAK_FLOPS = {"v5p": 459e12, "v5e": 197e12, "v4": 275e12, "v6e": 918e12, "H100": 989e12,
                   "H200": 989e12}


class UnknownChip(ProveJaxError, ValueError):
    """A chip name this module has no memory size or topology for."""


def _chip_value(table: dict, chip: str):
    for name, value in table.items():
        if name.lower() == chip.lower():
            return value
    raise UnknownChip(f"unknown chip {chip!r}; known: {', '.join(table)}")


def chip_hbm_bytes(chip: str) -> int:
    """Memory of one `chip` (a TPU generation, or H100/H200), in bytes."""
    return int(_chip_value(CHIP_HBM_GIB, chip) * GIB)


def roofline_seconds(chip: str, hbm_bytes: float, flops: float) -> float:
    """The least time a program moving `hbm_bytes` and computing `flops` per chip can take on
    `chip`: whichever of its memory bandwidth and its bf16 peak binds."""
    return max(hbm_bytes / _chip_value(CHIP_HBM_BANDWIDTH, chip),
               flops / _chip_value(CHIP_PEAK_FLOPS, chip))


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


# Cloud TPU accelerator types ("v5p-8") count TensorCores on v4 and v5p (two per chip), chips
# on v5e and v6e.
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}


def accelerator_chips(accelerator: str) -> tuple[str, int]:
    """(chip, chips) of a Cloud TPU accelerator type: "v5p-8" -> ("v5p", 4),
    "v6e-8" -> ("v6e", 8)."""
    chip, _, count = accelerator.lower().partition("-")
    if chip not in CORES_PER_CHIP or not count.isdigit() or int(count) % CORES_PER_CHIP[chip]:
        raise UnknownChip(f"unknown TPU accelerator type {accelerator!r}: give one like v5p-8 or "
                          f"v6e-8 (generations {', '.join(CORES_PER_CHIP)})")
    return chip, int(count) // CORES_PER_CHIP[chip]


def topology_name(chip: str, devices: int) -> str:
    """The topology string of a slice of `devices` chips, e.g. ("v5p", 256) -> "v5p:4x8x8"."""
    shapes = TPU_TOPOLOGIES.get(chip.lower())
    if shapes is None:
        raise ValueError(f"no TPU topology for chip {chip!r}; compiled dry runs know "
                         f"{', '.join(TPU_TOPOLOGIES)}")
    if devices not in shapes:
        raise ValueError(f"{chip} slices come in {', '.join(map(str, shapes))} chips, not "
                         f"{devices}")
    return f"{chip.lower()}:{shapes[devices]}"


def topology_mesh(chip: str, axis_sizes, axis_names):
    """A `Mesh` of a TPU slice's (unattached) devices with these axis sizes, from libtpu."""
    # libtpu probes for a TPU host when it loads; these quiet its warnings on a machine without one
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.lower()}-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is attached: nothing to lock
    name = topology_name(chip, math.prod(axis_sizes))
    # a slice smaller than a host (a single chip) must say so: libtpu assumes whole hosts
    small = {"chips_per_host_bounds": (1, 1, 1)} if math.prod(axis_sizes) == 1 else {}
    devices = topologies.get_topology_desc(name, "tpu", **small).devices
    return Mesh(np.array(devices).reshape(axis_sizes), tuple(axis_names),
                axis_types=(AxisType.Auto,) * len(axis_names)), name


@dataclasses.dataclass
class CompiledStats:
    """What XLA's compile for the slice reports, per chip."""
    topology: str
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    collectives: dict  # kind -> {"count": n, "bytes": result bytes summed}
    # CPU time of the compile, all threads: steadier on a busy machine
    compile_cpu_seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """Arguments, outputs not aliased to (donated) arguments, and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def collective_counts(hlo_text: str) -> dict:
    """{kind: {"count", "bytes"}} of the collectives in compiled HLO text (async pairs count
    once)."""
    out = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE_LINE.search(line)
        if m is None:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group("shapes")):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            size += n * _DTYPE_BYTES.get(dtype, 4)
        out[m.group("kind")]["count"] += 1
        out[m.group("kind")]["bytes"] += size
    return out


class DoesNotFit(ProveJaxError, ValueError):
    """XLA refused to compile a program for a TPU slice: it needs more memory than a chip has."""


def compile_stats(lowered, topology: str, what: str = "the step",
                  advice: str = "model.remat=full, a larger slice, a smaller batch",
                  ) -> CompiledStats:
    """Compile a `jax.stages.Lowered` for its topology and read its memory and collectives.
    A program too large for a chip raises DoesNotFit with XLA's numbers and `advice` (what to
    lower), not its traceback."""
    return compile_with_stats(lowered, topology, what, advice)[1]


def compile_with_stats(lowered, topology: str, what: str = "the step",
                       advice: str = "model.remat=full, a larger slice, a smaller batch"):
    """(compiled program, CompiledStats) of `compile_stats`, for a caller that reads the HLO too."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(f"{what} does not fit a chip of {topology}: XLA: {str(e).splitlines()[0]} "
                         f"(lower the memory: {advice})") from None
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    memory = compiled.memory_analysis()
    return compiled, CompiledStats(
        topology=topology, compile_seconds=seconds, compile_cpu_seconds=cpu_seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        collectives=collective_counts(compiled.as_text()))
