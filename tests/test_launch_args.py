"""distributed.py: multi-host start-up arguments reach `jax.distributed.initialize` by name
(bound to its real signature; nothing is started), are checked, and only a multi-host TPU slice
joins without them."""

from __future__ import annotations

import inspect

import jax
import pytest

from prove_jax import distributed


@pytest.fixture
def joined(monkeypatch):
    """Calls to jax.distributed.initialize, bound to its real signature (nothing is started)."""
    sig = inspect.signature(jax.distributed.initialize)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda *a, **k: calls.append(dict(sig.bind(*a, **k).arguments)))
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("MEGASCALE_COORDINATOR_ADDRESS", raising=False)
    return calls


def test_explicit_launch_arguments_reach_jax_by_name(joined):
    assert distributed.initialize("10.0.0.1:1234", 4, 3, heartbeat_timeout_s=20, init_timeout_s=90)
    assert joined == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                       "heartbeat_timeout_seconds": 20, "initialization_timeout": 90}]


def test_launch_arguments_are_checked_and_one_process_is_not_a_job(joined):
    for pid in (2, -1):
        with pytest.raises(distributed.DistributedError, match="outside"):
            distributed.initialize("h:1", 2, pid)
    with pytest.raises(distributed.DistributedError, match="go together"):
        distributed.initialize("h:1", 2, None)
    assert distributed.initialize("h:1", 1, 0) is False
    assert joined == []


def test_only_a_multi_host_tpu_slice_joins_without_arguments(joined, monkeypatch):
    assert distributed.initialize() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert distributed.initialize() is False and joined == []
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1")
    assert distributed.initialize() is True and joined == [{}]
