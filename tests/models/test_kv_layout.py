"""A stacked KV cache whose head dim is under 128 lanes (a Qwen2.5-0.5B's 64, the 7B's verifier)
is held as libtpu's scatter lays it out: held [B, K, L * S, Dh], libtpu laid a large one (from
133 MiB a chip) out slots minor for the step's scatter while the kernel read it as shaped, and
copied the whole cache in every layer of every step; a small one (up to 120 MiB) it keeps head
dim minor, and copied one held slots minor, [B, K, Dh, L * S]. So on TPU the cache is held slots
minor from `compute.KV_SLOTS_MINOR_MIN_BYTES` a chip, decided on the host from the resolved
`ComputeOptions.kv_slots_minor`; CPU and GPU keep [.., L * S, Dh], and a test may force either
(benchmarks/decode_step_cost.md)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from prove_jax import aot
from prove_jax.decoding import ComputeOptions, DecodeOptions, MemoryLayout
from prove_jax.decoding import dry_run, step_report
from prove_jax.decoding.dry_run import SliceRun
from prove_jax.models import attention, compute as compute_mod
from prove_jax.models.attention import KVCache
from prove_jax.models.config import ModelConfig
from prove_jax.models.sharding import MESH_AXES

HAVE_LIBTPU = aot.libtpu_available()
# the 0.5B's attention shape (24 layers, 14 query heads over 2 kv heads of 64: a chip's cache at
# 16 rows of 8k is over its VMEM), small elsewhere
CFG = ModelConfig(vocab_size=1024, hidden_size=896, intermediate_size=1024, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, mask_token_id=1023, eos_token_ids=(1,))
SLOTS_MINOR = ComputeOptions(kv_slots_minor=True)


def _held(rows: int, slots: int, compute: ComputeOptions, mesh=None, cfg=CFG) -> KVCache:
    """The stacked cache's shapes (abstract: nothing allocated), made under `mesh`."""
    make = lambda: KVCache.zeros(cfg, rows, slots, dtype=jnp.bfloat16, stacked=True,  # noqa: E731
                                 compute=compute)
    if mesh is None:
        return jax.eval_shape(make)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.eval_shape(make)


def test_the_layout_is_resolved_per_platform_on_the_host():
    """CPU and GPU resolve to head dim minor; TPU keeps the size rule (None); a forced choice
    survives resolving; only a stacked cache under 128 lanes is ever held slots minor."""
    assert ComputeOptions().resolve("cpu").kv_slots_minor is False
    assert ComputeOptions().resolve("gpu").kv_slots_minor is False
    assert ComputeOptions().resolve("tpu").kv_slots_minor is None
    assert SLOTS_MINOR.resolve("cpu").kv_slots_minor is True
    assert ComputeOptions(kv_slots_minor=False).resolve("tpu").kv_slots_minor is False
    assert compute_mod.LANES == attention.LANES == 128
    stacked = KVCache.zeros(CFG, 2, 32, stacked=True, compute=SLOTS_MINOR.resolve("cpu"))
    assert stacked.slots_minor and stacked.k.shape == (2, 2, 64, 24 * 32)
    assert stacked.slots_per_layer(CFG.num_layers) == 32
    view = stacked.scanned_layer(stacked.k, stacked.v, jnp.int32(1), CFG.num_layers)
    assert view.slots_minor and view.slots == 32 and view.read(0, 16)[0].shape == (2, 2, 16, 64)
    here = KVCache.zeros(CFG, 2, 32, stacked=True, compute=ComputeOptions().resolve("cpu"))
    assert not here.slots_minor and here.k.shape == (2, 2, 24 * 32, 64)
    assert here.slots_per_layer(CFG.num_layers) == 32
    wide = KVCache.zeros(CFG.replace(head_dim=128), 2, 32, stacked=True, compute=SLOTS_MINOR)
    assert not wide.slots_minor and wide.k.shape == (2, 2, 24 * 32, 128)
    per_layer = KVCache.zeros(CFG, 2, 32, compute=SLOTS_MINOR)
    assert not per_layer.slots_minor and per_layer.k[0].shape == (2, 2, 32, 64)
    assert per_layer.slots_per_layer(CFG.num_layers) == 32


def test_on_tpu_the_bytes_a_chip_pick_the_layout():
    """On TPU a stacked cache is held slots minor from KV_SLOTS_MINOR_MIN_BYTES of one buffer a
    chip, counted on the chip's shard under the mesh (rows over data, kv heads over tensor);
    on CPU never, whatever its size."""
    tpu, cpu = ComputeOptions().resolve("tpu"), ComputeOptions().resolve("cpu")
    row = CFG.num_kv_heads * CFG.num_layers * 1024 * CFG.head_dim * 2  # a row of 1024 slots, bf16
    least = -(-compute_mod.KV_SLOTS_MINOR_MIN_BYTES // row)  # rows from which a buffer is held so
    assert not _held(least - 1, 1024, tpu).slots_minor
    held = _held(least, 1024, tpu)
    assert held.slots_minor and held.k.shape == (least, 2, 64, 24 * 1024)
    assert not _held(least, 1024, cpu).slots_minor
    # split over 4 data shards, a chip holds a quarter of the rows
    mesh = AbstractMesh((4, 1, 1), MESH_AXES)
    assert not _held(4 * (least - 1), 1024, tpu, mesh).slots_minor
    assert _held(4 * least, 1024, tpu, mesh).slots_minor
    # 2 kv heads over tensor 2: a chip holds one head of every row
    mesh = AbstractMesh((1, 1, 2), MESH_AXES)
    assert not _held(2 * least - 2, 1024, tpu, mesh).slots_minor
    assert _held(2 * least, 1024, tpu, mesh).slots_minor


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
@pytest.mark.parametrize("context,slots_minor", [(8192, True), (2048, False)], ids=["8k", "2k"])
def test_on_tpu_a_step_with_64_wide_heads_copies_no_cache(context, slots_minor):
    """An AR step of 16 rows on v6e-4 through the Pallas kernel, layers scanned, of a model with
    the 0.5B's 64-wide heads: at 8k a chip's buffer (4 rows x 2 heads x 24 x 8208 slots x 64,
    bf16: 192 MiB) is held slots minor, at 2k (48 MiB) head dim minor, each as libtpu's scatter
    lays it out, and the compiled step copies no cache (8k held head dim minor, it copied the
    whole stacked cache in every layer: 2.1x what the 7B's verify steps must move; 2k held slots
    minor, 1.2-1.6x) and moves what it must within 1.3x."""
    options = DecodeOptions("ar", 1, memory=MemoryLayout(scan_layers=True), compute=ComputeOptions(attention="pallas_tpu"))
    run = SliceRun(CFG, options, chip="v6e", chips=4, batch=16, context=context)
    report = step_report.step_report(run, programs=("step",))
    (step,) = report.programs
    if slots_minor:  # an admission (a row a data shard: 48 MiB a chip) holds its rows' cache
        _, decoder, prompt = dry_run._on_slice(run)  # as the batch's they join, or would not trace
        fns, _, state = step_report.stream_programs(decoder, [prompt] * 16, run.new_tokens, 16)
        assert state.cache.slots_minor
        with jax.set_mesh(decoder.mesh):
            fns["admit"][0].lower(*fns["admit"][1])
    assert report.setting["mesh"]["data"] == 4  # a chip holds 4 rows, both heads
    total = CFG.num_layers * report.setting["slots"]
    chip_bytes = 4 * CFG.num_kv_heads * total * CFG.head_dim * 2
    tpu = dataclasses.replace(options.compute, platform="tpu")
    assert tpu.kv_held_slots_minor(CFG.head_dim, chip_bytes) is slots_minor
    cache = [t for t in step.largest if t[3] == "copy" and str(total) in t[4]]
    assert not cache, step.largest
    assert step.bytes_by_opcode.get("copy", 0) < 0.01 * step.hbm_bytes, step.largest
    assert step.waste <= 1.3
