"""memory.py: a program's memory from XLA's analysis, the fit check on simulated CPU devices
(which share the host's memory) and accelerators, and the host's free memory from
/proc/meminfo, which counts in kB."""

from __future__ import annotations

import types

import jax
import pytest

from prove_jax import memory


def _compiled(temp, output, alias, argument):
    analysis = types.SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=output,
                                     alias_size_in_bytes=alias, argument_size_in_bytes=argument)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


def test_program_memory_is_temporaries_plus_outputs_not_written_in_place():
    """Outputs aliased to (donated) inputs are not counted again."""
    assert memory.program_memory(_compiled(100, 50, 30, 1000)) == 120
    assert memory.program_memory(_compiled(100, 50, 30, 1000), with_arguments=True) == 1120
    assert memory.program_memory(_compiled(100, 50, 50, 1000)) == 100  # a decode step's cache update


def test_simulated_cpu_devices_share_the_host_memory_accelerators_do_not(monkeypatch):
    """Simulated CPU devices multiply the per-device need by the device count; accelerators,
    each with its own memory, do not."""
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 400)
    compiled = _compiled(120, 0, 0, 0)
    cpus = [jax.devices("cpu")[0]] * 4  # only the count and the first device's platform matter
    memory.check_fits(compiled, cpus[:3], "x", "y")  # 360 <= 400
    with pytest.raises(MemoryError, match="the host has"):
        memory.check_fits(compiled, cpus, "x", "y")  # 480 > 400
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100")
    memory.check_fits(compiled, [gpu] * 8, "x", "y")  # each has its own 400
    with pytest.raises(MemoryError, match="each NVIDIA H100 has"):
        memory.check_fits(_compiled(401, 0, 0, 0), [gpu] * 8, "x", "y")


def test_host_free_memory_is_meminfo_kilobytes_in_bytes(monkeypatch):
    """/proc/meminfo's MemAvailable is in kB (proc(5)), returned in bytes."""
    import io
    text = "MemTotal:       16384000 kB\nMemFree:          100000 kB\nMemAvailable:    2048000 kB\n"
    monkeypatch.setattr(memory, "open", lambda path, *a, **k: io.StringIO(text), raising=False)
    cpu = types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)
    assert memory.free_device_memory(cpu) == 2048000 * 1024
