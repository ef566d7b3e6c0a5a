"""The paged KV pool (`DecodeOptions(page_size=..., kv_pages=...)`, models/paged.py).

Checked here: a forward through a pool whose pages lie shuffled gives the contiguous cache's
hidden states (one-pass and chunked reads, one-token and wide steps); pages are taken and given
back without overlap; decoding through a pool smaller than every row's worst case gives AR's
tokens in every mode, on the batch and the stream paths, with requests waiting for pages (the
loop serves one at a time when only one fits); the compiled program holds less memory; a tensor
mesh gathers nothing; and bad settings are one-line errors.
"""

import functools
import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.decoding import DecodeOptions, Decoder, ComputeOptions, LosslessRule, MemoryLayout
from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.sampling import SamplingParams
from prove_jax.models import sharding
from prove_jax.models.attention import StepMask, causal_mask
from prove_jax.models.paged import PagedKVCache, pages_needed
from prove_jax.models.params import create_model
from tests.decoding.test_decode_in_place import CFG, moves_of_shape
from tests.decoding.test_inference_mesh import CFG as MESH_CFG, NEW, PROMPTS, collectives

XLA = ComputeOptions()
TPU_INTERPRET = ComputeOptions(attention="pallas_tpu", interpret=True)
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
# mixed lengths: the longest request needs 4x the pages of the shortest
LENGTHS = [3, 40, 5, 12, 70, 2, 9]
MODES = {
    "ar": DecodeOptions("ar"),
    "lossless": DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)),
    "verify": DecodeOptions("verify", 3),
}


def paged(options: DecodeOptions, page_size: int, kv_pages: int | None = None) -> DecodeOptions:
    return dataclasses.replace(options, memory=dataclasses.replace(options.memory, page_size=page_size, kv_pages=kv_pages))


@pytest.fixture(scope="module")
def models():
    return create_model(CFG, seed=0), create_model(CFG.replace(num_layers=1, mask_token_id=None), seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(2, 90, k).tolist() for k in LENGTHS]


@pytest.mark.parametrize("slots,compute", [(64, XLA), (1024, XLA), (64, TPU_INTERPRET)],
                         ids=["one-pass", "chunked", "pallas_tpu"])
def test_a_shuffled_pool_reads_as_the_contiguous_cache(models, slots, compute):
    """Prefill 3 rows of different lengths, then a one-token and a wide step with a non-causal
    intra mask, both through a contiguous cache and through a pool whose pages are handed out
    in shuffled order: the hidden states are the same (the chunked read visits pages in chunks;
    the paged Pallas TPU kernel, in interpret mode, reads each row's pages through its table)."""
    model = models[0]
    rows, page = 3, 8
    lens = jnp.asarray([5, 37, 20], jnp.int32)
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(2, 90, (rows, 40)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (rows, 40))
    prefill = StepMask(jnp.zeros(rows, jnp.int32), causal_mask(rows, 40) & (positions < lens[:, None])[:, None, :])
    pool = PagedKVCache.zeros(model.cfg, rows, slots // page, num_pages=rows * slots // page + 3, page_size=page)
    # every other page taken by no one, so the rows' pages are scattered over the pool
    taken = rng.permutation(pool.pages_per_shard)[: pool.pages_per_shard // 2]
    pool = pool.replace(free=pool.free.at[0, jnp.asarray(taken)].set(False))
    pool = pool.allocate(jnp.asarray([2, 6, 4], jnp.int32))
    owned = np.asarray(pool.table)[np.asarray(pool.table) < pool.pages_per_shard]
    assert len(set(owned.tolist())) == 12 and not set(owned.tolist()) & set(taken.tolist())
    forward = jax.jit(functools.partial(model.hidden_states, compute=compute))
    _, contiguous = jax.jit(model.hidden_states)(tokens, positions, prefill, model.new_cache(rows, slots))
    _, pool = forward(tokens, positions, prefill, pool)
    for width, intra in [(1, jnp.ones((1, 1, 1), bool)),
                         (5, jnp.asarray(rng.rand(rows, 5, 5) < 0.6) | jnp.eye(5, dtype=bool)[None])]:
        step = jnp.asarray(rng.randint(2, 90, (rows, width)), jnp.int32)
        at = lens[:, None] + jnp.arange(width)[None, :]
        mask = StepMask(lens, intra)
        want, new_contiguous = jax.jit(model.hidden_states)(step, at, mask, contiguous)
        got, new_pool = forward(step, at, mask, pool)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the step's keys landed on the rows' own pages, where the contiguous cache has them
    k = new_pool.layer(0).read(0, slots)[0]
    for r, n in enumerate(np.asarray(lens) + 5):
        np.testing.assert_allclose(np.asarray(k[r, :, :n]), np.asarray(new_contiguous.k[0][r, :, :n]), atol=1e-6)


def test_pages_of_one_slot_read_as_the_contiguous_cache(models):
    """page_size 1: every slot a page of its own (the one-pass read goes through the table)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    want = Decoder(models[0], [1], MODES["lossless"]).generate(prompts, 12).output_ids
    assert Decoder(models[0], [1], paged(MODES["lossless"], 1)).generate(prompts, 12).output_ids == want


def test_pages_are_taken_without_overlap_and_given_back():
    pool = PagedKVCache.zeros(CFG, 4, 6, num_pages=12, page_size=4)
    need = pages_needed(jnp.asarray([3, 9, 1, 5]), jnp.asarray([5, 6, 0, 2]), 4)
    assert need.tolist() == [2, 4, 0, 2]
    taken = pool.allocate(need)
    table = np.asarray(taken.table)
    owned = [row[row < 12].tolist() for row in table]
    assert [len(o) for o in owned] == need.tolist()
    flat = sum(owned, [])
    assert len(set(flat)) == len(flat) == 8 and taken.free_pages().tolist() == [4]
    assert not np.asarray(taken.free)[0, flat].any()
    back = taken.release(jnp.asarray([False, True, False, True]))
    assert back.free_pages().tolist() == [4 + 6] and np.asarray(back.table)[[1, 3]].min() == 12
    assert np.asarray(back.table)[0].tolist() == table[0].tolist()


def test_each_data_shard_has_its_own_pool():
    """Under a data=2 mesh a 4-row batch has two pools: rows 0-1 take pages of the first, rows
    2-3 of the second, and a view's rows (an admission) take them from the shard named."""
    mesh = sharding.make_mesh((2, 1, 1))
    with jax.set_mesh(mesh):
        pool = jax.jit(lambda: PagedKVCache.zeros(CFG, 4, 4, num_pages=12, page_size=4))()
        assert pool.shards == 2 and pool.pages_per_shard == 6
        taken = jax.jit(lambda p: p.allocate(jnp.asarray([2, 3, 1, 4], jnp.int32)))(pool)
        assert taken.free_pages().tolist() == [1, 1]
        view = jax.jit(lambda p: p.release(jnp.asarray([True, True, False, False]))
                       .allocate(jnp.asarray([4], jnp.int32), home=jnp.asarray([0])))(taken)
    assert view.free_pages().tolist() == [2, 1] and len(set(np.asarray(view.table)[0].tolist())) == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_decoding_through_a_small_pool_gives_ars_tokens(models, prompts, mode):
    """3 rows, 7 requests of 2 to 70 prompt tokens, a pool of 16 pages of 8 slots: the longest
    request needs 12 of them, so it decodes with at most one short one beside it. Lossless is
    AR token for token, on the batch and the stream paths, and sampled lossless draws what the
    contiguous program draws; ar and verify equal their contiguous programs."""
    proposer, verifier = models
    kwargs = dict(verifier=verifier) if mode == "verify" else {}
    want = Decoder(proposer, [1], MODES[mode], **kwargs).generate(prompts, 24, batch_size=3)
    decoder = Decoder(proposer, [1], paged(MODES[mode], 8, kv_pages=16), **kwargs)
    got = decoder.generate(prompts, 24, batch_size=3)
    assert got.output_ids == want.output_ids
    np.testing.assert_array_equal(got.forwards, want.forwards)
    if mode == "ar":
        return
    if mode == "lossless":
        assert got.output_ids == Decoder(proposer, [1], MODES["ar"]).generate(prompts, 24).output_ids
        # sampling draws from each row's own keys: the pool changes no draw
        hot = SamplingParams(temperature=0.8, top_p=0.9)
        sampled = [d.generate(prompts, 24, batch_size=3, params=hot, seed=3).output_ids
                   for d in (Decoder(proposer, [1], MODES[mode]), decoder)]
        assert sampled[0] == sampled[1]
    # the stream admits and releases on the host (verify: the verifier's pool with the proposer's)
    streamed = {}
    for event in decoder.stream(prompts, 24, batch_size=3, chunk_steps=3):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(prompts))] == want.output_ids


def test_in_bfloat16_the_pool_decodes_what_contiguous_rows_decode(prompts):
    """bfloat16 weights and KV (as on a TPU or GPU): pages hold the same bf16 keys and values as
    contiguous rows and are read into the same attention, so lossless and verify through a
    small pool commit the contiguous programs' tokens at the same steps."""
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    proposer = create_model(CFG.replace(**bf16), seed=0)
    verifier = create_model(CFG.replace(num_layers=1, mask_token_id=None, **bf16), seed=1)
    for mode in ("lossless", "verify"):
        kwargs = dict(verifier=verifier) if mode == "verify" else {}
        want = Decoder(proposer, [1], MODES[mode], **kwargs).generate(prompts, 16, batch_size=3)
        got = Decoder(proposer, [1], paged(MODES[mode], 8, kv_pages=16), **kwargs).generate(prompts, 16, batch_size=3)
        assert got.output_ids == want.output_ids, mode
        np.testing.assert_array_equal(got.forwards, want.forwards)


def test_scanned_layers_carry_stacked_pools_in_place(models, prompts):
    """With scan_layers the pools of every layer are one [D, K, L, Pl, page, Dh] array carried
    through the scan: lossless through it is AR token for token on the batch and stream paths,
    and the loop never copies a pool, nor one layer's."""
    model = create_model(CFG.replace(num_layers=3), seed=0)
    want = Decoder(model, [1], MODES["ar"]).generate(prompts, 24).output_ids
    options = DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(page_size=8, kv_pages=16, scan_layers=True))
    decoder = Decoder(model, [1], options)
    assert decoder.generate(prompts, 24, batch_size=3).output_ids == want
    streamed = {}
    for event in decoder.stream(prompts, 24, batch_size=3, chunk_steps=3):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(prompts))] == want
    ((_, compiled),) = decoder.programs("run")
    hlo = compiled.as_text()
    pool = (1, CFG.num_kv_heads, 3, 16, 8, CFG.head_dim)
    assert "f32[{},{},{},{},{},{}]".format(*pool) in hlo  # the shape looked for is the pools'
    assert not moves_of_shape(hlo, pool) and not moves_of_shape(hlo, pool[:2] + pool[3:])


def test_a_pool_that_holds_one_request_serves_them_one_at_a_time(models):
    """A pool of the longest request's pages, which no two requests fit together: every request
    still decodes, but one at a time, so the loop runs at least as many steps as all requests'
    forwards together (with the default pool, 3 rows decode side by side and it runs far fewer)."""
    options = paged(MODES["lossless"], 16)
    decoder = Decoder(models[0], [1], options)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(2, 90, k).tolist() for k in (40, 70, 50, 60, 45)]
    need = int(decoder.pages_needed([len(p) for p in prompts], 24).max())
    one = Decoder(models[0], [1], paged(MODES["lossless"], 16, kv_pages=need)).generate(prompts, 24, batch_size=3)
    side_by_side = decoder.generate(prompts, 24, batch_size=3)
    assert one.output_ids == side_by_side.output_ids
    assert one.loop_steps >= int(one.forwards.sum())
    assert side_by_side.loop_steps < 0.6 * int(side_by_side.forwards.sum())


@pytest.mark.parametrize("mode", ["lossless", "verify"])
def test_the_pool_takes_less_memory_than_contiguous_rows(models, prompts, mode):
    """Compiled for 3 rows at the 70-token prompt: the contiguous program holds 3 rows of the
    longest request's slots; a pool of 16 pages of 8 slots holds 128 slots in all. Verify's
    verifier (here as deep as the proposer) keeps its KV on the same pages, so it saves as much
    again."""
    kwargs = {}
    if mode == "verify":
        kwargs["verifier"] = create_model(CFG.replace(mask_token_id=None), seed=1)
    contiguous = Decoder(models[0], [1], MODES[mode], **kwargs)
    pool = Decoder(models[0], [1], paged(MODES[mode], 8, kv_pages=16), **kwargs)

    def bytes_of(decoder):
        compiled = decoder.lower(prompts, 24, batch_size=3).compile()
        stats = compiled.memory_analysis()
        return stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes

    cache_bytes = lambda slots: 2 * CFG.num_layers * CFG.num_kv_heads * slots * CFG.head_dim * 4  # noqa: E731
    saved = bytes_of(contiguous) - bytes_of(pool)
    # contiguous rows: 3 x (buffer 128 + step width) slots; the pool: 128 slots, less the pages
    # the XLA read gathers per layer as temporaries (one layer's rows at a time)
    if mode == "lossless":
        want = cache_bytes(3 * 138) - cache_bytes(128)  # step width 10
    else:  # proposer: step width 5 (K=3); verifier: buffer 128 + K 3, on a pool as the proposer's
        want = cache_bytes(3 * 133) + cache_bytes(3 * 131) - 2 * cache_bytes(128)
    assert saved >= 0.6 * want, (saved, want)


def test_on_a_mesh_each_data_shard_has_its_pool_split_over_kv_heads_and_nothing_is_gathered():
    """data=2 x tensor=4: each data shard's rows keep their pages in that shard's pool, whose kv
    heads lie over the tensor axis, so the decode step (the stream's chunk program) moves no key,
    value or page between devices; outputs are one device's AR. (Admission, a few rows
    prefilled into pools on any shard, reads and writes by explicit shard indices.)"""
    model = create_model(MESH_CFG, seed=3)
    mesh = sharding.make_mesh((2, 1, 4))
    graphdef, state = nnx.split(model)
    on_mesh = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    want = Decoder(model, [1], DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids
    options = paged(DecodeOptions("lossless", 4, compute=ComputeOptions(matmul_form="plain")), 8, kv_pages=8)
    decoder = Decoder(on_mesh, [1], options, mesh=mesh)
    streamed = {}
    for event in decoder.stream(PROMPTS, NEW, batch_size=2):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(PROMPTS))] == want
    (compiled,) = [c for key, c in decoder.programs("chunk")]
    found = collectives(compiled.as_text())
    assert {op for op, _, _ in found} <= {"all-reduce"}, found
    # float all-reduces are the tensor axis' activations [rows, T, hidden] and the LM head's
    # per-row maxima: nothing shaped like keys, values or pages
    assert all(len(shape) <= 2 or shape[-1] == MESH_CFG.hidden_size for _, dt, shape in found if dt == "f32"), found
    pool = compiled.output_shardings.cache.k[0]
    assert tuple(pool.spec)[:2] == (("data",), "tensor") or tuple(pool.spec)[:2] == ("data", "tensor"), pool.spec
    assert decoder.generate(PROMPTS, NEW, batch_size=2).output_ids == want


def test_lossless_through_the_paged_tpu_kernel_is_ar(models, prompts):
    """The paged Pallas TPU kernel (interpret mode) reads the committed pages of every step,
    prefill included; lossless stays AR token for token."""
    few = [prompts[3], prompts[0], prompts[5]]  # 12, 3 and 2 tokens: interpret mode is slow
    want = Decoder(models[0], [1], MODES["ar"]).generate(few, 14).output_ids
    options = paged(DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), compute=TPU_INTERPRET), 8, kv_pages=6)
    assert Decoder(models[0], [1], options).generate(few, 14, batch_size=2).output_ids == want


@pytest.mark.parametrize("mode,scan_layers", [("lossless", False), ("lossless", True), ("verify", True)],
                         ids=["unrolled", "scanned", "verify-scanned"])
@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (docs/environment.md)")
def test_the_paged_tpu_kernel_compiles_for_v5p_8_with_no_large_collective(mode, scan_layers):
    """The whole paged program with the Pallas kernel (verify: the verifier's pools too),
    compiled by the dry run for v5p-8 (4 chips, data parallel): it fits, and nothing the size of
    a page pool is gathered."""
    from prove_jax.decoding.dry_run import dry_run_decode, SliceRun
    from tests.decoding.test_decode_dry_run import CFG as TPU_CFG
    cfg = TPU_CFG.replace(head_dim=128)
    options = DecodeOptions(mode, 4, lossless=LosslessRule(max_groups=2 if mode == "lossless" else None), memory=MemoryLayout(page_size=128, scan_layers=scan_layers), compute=ComputeOptions(attention="pallas_tpu"))
    verifier = cfg.replace(num_layers=1, mask_token_id=None) if mode == "verify" else None
    report = dry_run_decode(SliceRun(cfg, options, chip="v5p", chips=4, batch=8, context=512, new_tokens=64,
                            verifier=verifier))
    assert report.fits and report.mesh["data"] == 4
    assert all(v["bytes"] < 2**20 for v in report.stats.collectives.values()), report.stats.collectives


def test_bad_paged_settings_are_one_line_errors(models, prompts):
    with pytest.raises(DecodeError, match="give a page size too"):
        DecodeOptions("ar", memory=MemoryLayout(kv_pages=4)).validate()
    with pytest.raises(DecodeError, match="page size must be"):
        DecodeOptions("ar", memory=MemoryLayout(page_size=0)).validate()
    with pytest.raises(DecodeError, match="read by --attention xla or pallas_tpu, not pallas_gpu"):
        DecodeOptions("ar", memory=MemoryLayout(page_size=8), compute=ComputeOptions(attention="pallas_gpu")).validate()
    decoder = Decoder(models[0], [1], paged(MODES["ar"], 8, kv_pages=4))
    with pytest.raises(DecodeError, match=r"^prompt 1 needs 8 KV pages of 8 slots \(40 prompt tokens \+ 24 new\), more than the pool.s 4: raise --kv-pages"):
        decoder.generate(prompts, 24)


def test_a_request_too_big_for_the_pool_fails_alone(tmp_path, models, prompts, capsys):
    """generate --kv-pages: a request that needs more pages than the pool has gets an error
    record naming its pages and the pool's; the others decode as AR would (exit status 3)."""
    import json

    from prove_jax.checkpoints.checkpoint import save_model
    from prove_jax.cli import generate
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, models[0])
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = {2: "big"}  # 70 prompt tokens + 24 new: 12 pages of 8, the pool has 8
    inp.write_text("".join(json.dumps({"id": ids.get(i, i), "prompt_ids": p}) + "\n"
                           for i, p in enumerate(prompts[2:6])))
    args = ["--model", ckpt, "--mode", "lossless", "--input", str(inp), "--output", str(out),
            "--max-new-tokens", "24", "--batch-size", "2", "--page-size", "8", "--kv-pages", "8", "--sort", "--mesh", "1,1,1"]
    assert generate.main(args) == generate.SOME_REQUESTS_FAILED
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[2] == {"id": "big", "error": rows[2]["error"]}
    assert rows[2]["error"].startswith("the prompt needs 12 KV pages of 8 slots (70 prompt tokens + 24 new), "
                                       "more than the pool's 8: raise --kv-pages"), rows[2]["error"]
    good = [p for i, p in enumerate(prompts[2:6]) if i != 2]
    want = Decoder(models[0], [1], MODES["ar"]).generate(good, 24).output_ids
    assert [r["output_ids"] for r in rows if "error" not in r] == want
    capsys.readouterr()


def test_generate_takes_page_flags():
    from prove_jax.cli import generate
    options = generate.decode_options(generate.parse_args(
        ["--prompt", "x", "--mode", "lossless", "--page-size", "16", "--kv-pages", "64"]))
    assert (options.memory.page_size, options.memory.kv_pages) == (16, 64)
    with pytest.raises(DecodeError, match="^--page-size must be"):
        generate.decode_options(generate.parse_args(["--prompt", "x", "--page-size", "0"]))
