"""A verifier whose head dim is under 128 lanes (the 7B's 0.5B verifier, 64) keeps a contiguous
cache beside the proposer's paged pool on TPU (`paged.pooled`, `ComputeOptions.pools_kv`):
libtpu laid out the scatter into its pool slots minor while the paged kernel read it head dim
minor, and copied the whole pool in every layer of every step (7B verify K=8 paged: 4.15-13.28x
what the step must move; benchmarks/decode_step_cost.md). Decided on the host from the resolved
compute options; CPU and GPU keep it pooled, and a test may force either
(`ComputeOptions.pool_narrow_kv`)."""

import dataclasses

import numpy as np
import pytest

from prove_jax import aot
from prove_jax.decoding import ComputeOptions, DecodeOptions, Decoder, MemoryLayout
from prove_jax.decoding import step_report
from prove_jax.decoding.dry_run import SliceRun
from prove_jax.models import paged
from prove_jax.models.attention import KVCache
from prove_jax.models.config import ModelConfig
from prove_jax.models.paged import PagedKVCache
from prove_jax.models.params import create_model
from tests.decoding.test_decode_in_place import CFG

HAVE_LIBTPU = aot.libtpu_available()
NARROW = CFG.replace(num_layers=1, mask_token_id=None)  # heads of 24 lanes
WIDE = NARROW.replace(head_dim=128)


def _paged(options: DecodeOptions) -> DecodeOptions:
    return dataclasses.replace(options, memory=dataclasses.replace(options.memory, page_size=8,
                                                                   kv_pages=24))


def test_the_pool_rule_is_resolved_per_platform_on_the_host():
    """TPU-resolved options keep a verifier of heads under 128 lanes out of the pool, CPU- and
    GPU-resolved ones pool it; 128 lanes and over always pool; a forced choice survives
    resolving."""
    tpu, cpu, gpu = (ComputeOptions().resolve(p) for p in ("tpu", "cpu", "gpu"))
    assert (tpu.pool_narrow_kv, cpu.pool_narrow_kv, gpu.pool_narrow_kv) == (False, True, True)
    assert not paged.pooled(NARROW, 4, tpu)
    assert paged.pooled(NARROW, 4, cpu) and paged.pooled(NARROW, 4, gpu)
    assert paged.pooled(WIDE, 4, tpu)
    assert ComputeOptions(pool_narrow_kv=True).resolve("tpu").pool_narrow_kv is True
    assert paged.pooled(NARROW, 4, ComputeOptions(pool_narrow_kv=True).resolve("tpu"))
    assert not paged.pooled(NARROW, 4, ComputeOptions(pool_narrow_kv=False).resolve("cpu"))


def test_a_narrow_verifier_beside_the_pool_decodes_as_the_contiguous_program():
    """Forced out of the pool on CPU (as on TPU): the paged verify program, admitting requests
    into a pool too small for every request at once as rows finish, decodes what the contiguous
    verify program does, and its verifier's cache is contiguous beside the proposer's pool."""
    model, verifier = create_model(CFG, seed=0), create_model(NARROW, seed=1)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, 90, n).tolist() for n in (3, 30, 5, 12)]
    options = DecodeOptions("verify", 3, compute=ComputeOptions(pool_narrow_kv=False))
    decoder = Decoder(model, [1], _paged(options), verifier=verifier)
    _, _, state = step_report.stream_programs(decoder, prompts[:2], 10, 2)
    assert isinstance(state.cache, PagedKVCache) and isinstance(state.verifier_cache, KVCache)
    want = Decoder(model, [1], options, verifier=verifier).generate(prompts, 10, batch_size=2)
    assert decoder.generate(prompts, 10, batch_size=2).output_ids == want.output_ids


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
def test_on_tpu_a_paged_step_copies_no_narrow_verifier_cache():
    """A paged verify K=8 step of 16 rows of 8k on v6e-4 through the Pallas kernel, with a
    verifier of the 0.5B's attention shape (24 layers, 2 kv heads of 64) beside a small
    proposer: its cache contiguous beside the pool, the step copies nothing and moves what it
    must within 1.3x (forced into the pool it copied the whole pool per layer per step: 82x
    here, 4.28x on the 7B)."""
    verifier = ModelConfig(vocab_size=1024, hidden_size=896, intermediate_size=1024, num_layers=24,
                           num_heads=14, num_kv_heads=2, head_dim=64, eos_token_ids=(1,))
    proposer = verifier.replace(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                                hidden_size=1024, mask_token_id=1023)
    options = DecodeOptions("verify", 8, memory=MemoryLayout(scan_layers=True, page_size=64),
                            compute=ComputeOptions(attention="pallas_tpu"))
    run = SliceRun(proposer, options, chip="v6e", chips=4, batch=16, context=8192,
                   verifier=verifier)
    report = step_report.step_report(run, programs=("step",))
    (step,) = report.programs
    assert step.bytes_by_opcode.get("copy", 0) < 0.01 * step.hbm_bytes, step.largest
    assert step.waste <= 1.3, step.largest
