"""A stacked KV cache whose head dim is under 128 lanes (a Qwen2.5-0.5B's 64, the 7B's verifier)
is held slots minor, [B, K, Dh, L * S]: held [B, K, L * S, Dh], libtpu laid it out slots minor
anyway for the step's scatter while the kernel read it as shaped, and copied the whole cache in
every layer of every step (benchmarks/decode_step_cost.md)."""

import jax.numpy as jnp
import pytest

from prove_jax import aot
from prove_jax.decoding import ComputeOptions, DecodeOptions, MemoryLayout
from prove_jax.decoding import step_report
from prove_jax.decoding.dry_run import SliceRun
from prove_jax.models import attention
from prove_jax.models.attention import KVCache
from prove_jax.models.config import ModelConfig

HAVE_LIBTPU = aot.libtpu_available()
# the 0.5B's attention shape (24 layers, 14 query heads over 2 kv heads of 64: a chip's cache at
# 16 rows of 8k is over its VMEM), small elsewhere
CFG = ModelConfig(vocab_size=1024, hidden_size=896, intermediate_size=1024, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, mask_token_id=1023, eos_token_ids=(1,))


def test_only_a_stacked_cache_under_128_lanes_is_held_slots_minor():
    """The per-layer buffers and a stacked one of 128-wide heads keep [.., slots, Dh]."""
    stacked = KVCache.zeros(CFG, 2, 32, stacked=True)
    assert stacked.slots_minor and stacked.k.shape == (2, 2, 64, 24 * 32)
    assert stacked.slots_per_layer(CFG.num_layers) == 32
    wide = KVCache.zeros(CFG.replace(head_dim=128), 2, 32, stacked=True)
    assert not wide.slots_minor and wide.k.shape == (2, 2, 24 * 32, 128)
    per_layer = KVCache.zeros(CFG, 2, 32)
    assert not per_layer.slots_minor and per_layer.k[0].shape == (2, 2, 32, 64)
    assert per_layer.slots_per_layer(CFG.num_layers) == 32
    view = stacked.scanned_layer(stacked.k, stacked.v, jnp.int32(1), CFG.num_layers)
    assert view.slots_minor and view.slots == 32 and view.read(0, 16)[0].shape == (2, 2, 16, 64)


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
def test_on_tpu_a_step_with_64_wide_heads_copies_no_cache():
    """An AR step of 16 rows of 8k on v6e-4 through the Pallas kernel, layers scanned, of a
    model with the 0.5B's 64-wide heads: the compiled step copies no cache (held [B, K, L * S,
    Dh] it copied the whole stacked cache, 2 x 4 x 2 x 32848 x 64 bf16 a chip, in every layer:
    2.1x what the 7B's verify steps must move) and moves what it must within 1.3x."""
    options = DecodeOptions("ar", 1, memory=MemoryLayout(scan_layers=True), compute=ComputeOptions(attention="pallas_tpu"))
    report = step_report.step_report(SliceRun(CFG, options, chip="v6e", chips=4, batch=16, context=8192),
                                     programs=("step",))
    (step,) = report.programs
    cache = [t for t in step.largest if t[3] == "copy" and f",{CFG.head_dim}," in t[4]]
    assert not cache, step.largest
    assert step.bytes_by_opcode.get("copy", 0) < 0.01 * step.hbm_bytes, step.largest
    assert step.waste <= 1.3
    assert attention.LANES == 128
