"""The inference mesh for big models: tensor parallelism over the kv heads, data over the rest.

On 8 simulated CPU devices as data=2 x tensor=4, the compiled decode step (the stream's chunk
program) holds no all-gather of anything: each device keeps its kv heads' weights and KV cache
and writes its own rows and heads of the cache; what crosses devices is the tensor-parallel
all-reduce of activations. Its outputs equal one device's, token for token.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, ComputeOptions, MemoryLayout
from prove_jax.decoding.loading import build_decoder, parse_mesh
from prove_jax.decoding.program import cache_slots, step_shape
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig, preset
from prove_jax.models.params import create_model, flat_params
from tests.decoding.test_decode_in_place import moves_of_shape

# 4 kv heads (8 query heads), vocab and mlp widths that 4 divides: every weight splits 4 ways.
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=8, mask_token_id=95, eos_token_ids=(1,))
PROMPTS = [np.random.RandomState(0).randint(2, 90, n).tolist() for n in (3, 9, 1, 14)]
NEW = 12
GIB = 2**30

# a result's first array: `= f32[..]{..} op(` or a tuple's, `= (f32[..]{..}, f32[..]{..}) op(`
_COLLECTIVE = re.compile(r"= \(?(\w+)\[([\d,]*)\][^()=]*?\)? (all-gather|all-to-all|reduce-scatter|all-reduce|"
                         r"collective-permute)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, element type, shape) of every collective in an HLO text (of a tuple's first array)."""
    return [(op, dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims, op in _COLLECTIVE.findall(hlo)]


GATHERS = ("all-gather", "all-to-all", "reduce-scatter")


def admissions(decoder):
    """(settings, HLO text) of every admission program the decoder's stream compiled."""
    found = [(key[2], c.as_text()) for key, c in decoder.programs("admit")]
    assert found, "the stream admitted nothing: the test no longer covers admission"
    return found


@pytest.fixture(scope="module")
def models():
    """The model on one device, and on a data=2 x tensor=4 mesh (weights placed by the rules)."""
    model = create_model(CFG, seed=3)
    mesh = sharding.make_mesh((2, 1, 4))
    graphdef, state = nnx.split(model)
    return model, nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh))), mesh


@pytest.fixture(scope="module")
def one_device(models):
    return Decoder(models[0], [1], DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids


def _stream(decoder, rows=4):
    out = {}
    for event in decoder.stream(PROMPTS, NEW, batch_size=rows):
        if event.output is not None:
            out[event.index] = event.output.output_ids
    return [out[i] for i in range(len(PROMPTS))]


def _chunk_program(decoder):
    """The compiled decode step of the stream's last run: up to N steps in a while loop."""
    (compiled,) = [c for key, c in decoder.programs("chunk")]
    return compiled


@pytest.mark.parametrize("options, rows", [
    (DecodeOptions("ar"), 2),  # one row, one kv head and one token per device
    (DecodeOptions("lossless", 4), 4),
    (DecodeOptions("lossless", 4, compute=ComputeOptions(matmul_form="plain")), 4)],
    ids=["ar", "lossless", "lossless-plain"])
def test_decode_step_on_a_tensor_mesh_gathers_nothing_and_equals_one_device(models, one_device, options, rows):
    model, sharded, mesh = models
    # the weights lie split over their kv heads, mlp and vocab, whole on embed
    q = sharded.layers[0].attn.q_kernel[...]
    assert q.addressable_shards[0].data.shape == (2, 8, 32)
    assert sharded.lm_head[...].addressable_shards[0].data.shape == (24, 32)

    decoder = Decoder(sharded, [1], options, mesh=mesh)
    assert _stream(decoder, rows) == one_device  # lossless == AR token for token, on the mesh
    assert decoder.generate(PROMPTS, NEW, batch_size=2).output_ids == one_device

    if rows == 2:  # 4 requests for 2 rows: admitted between chunks, each written on its shard
        assert all(not [c for c in collectives(h) if c[0] in GATHERS] for _, h in admissions(decoder))
    compiled = _chunk_program(decoder)
    hlo = compiled.as_text()
    found = collectives(hlo)
    # Nothing is gathered: no weight, no cache, not even a token index.
    assert not [c for c in found if c[0] in ("all-gather", "all-to-all", "reduce-scatter")], found
    # What crosses devices is activations of the step: rows per data shard x W tokens x hidden
    # at most (the all-reduces after the attention and MLP output projections, of the embedding
    # lookup from the vocab-split table, of the argmax's max and index over vocab shards, and of
    # the loop condition). The CPU weight-major form pads a product's token rows to 8-row
    # tiles across the data shards, which moves a few hidden rows (collective-permute); the
    # plain form that accelerators run moves none.
    width = 1 if options.mode == "ar" else 16
    assert all(np.prod(shape) <= rows // 2 * width * CFG.hidden_size for _, _, shape in found), found
    assert {op for op, _, _ in found} <= {"all-reduce", "collective-permute"}
    if options.mode == "ar" or options.compute.matmul_form == "plain":
        assert {op for op, _, _ in found} == {"all-reduce"}
    # one all-reduce per output projection (2 per layer) and one for the embedding lookup,
    # whatever the cache length
    hidden = [c for c in found if c[0] == "all-reduce" and c[1] == "f32" and CFG.hidden_size in c[2]]
    assert len(hidden) == 2 * CFG.num_layers + 1, found

    # the KV cache comes back split over rows and kv heads, as the model writes it, and each
    # device's buffers [rows / 2, 1 head, S, Dh] are updated in place (no copy in the loop)
    state = compiled.output_shardings
    for buffers in (state.cache.k, state.cache.v):
        assert all(s.spec == P("data", "tensor") for s in buffers), [s.spec for s in buffers]
    (key,) = [key for key, _ in decoder.programs("chunk")]
    local = (rows // 2, 1, cache_slots(key[2].num_slots + step_shape(key[2].options)[0]), CFG.head_dim)
    assert "f32[{},{},{},{}]".format(*local) in hlo
    assert not moves_of_shape(hlo, local)


@pytest.mark.slow
def test_a_verifier_whose_kv_heads_the_tensor_axis_does_not_divide_gathers_nothing(models):
    """A Qwen2.5-3B verifier has 2 kv heads, a 32B proposer 8: on tensor=4 the verifier's k/v
    weights stay whole on each tensor device (its query heads split 4 ways); its cache was
    all-gathered in every layer when GSPMD split the write 2 ways on its own. With rows enough
    for every device, its cache and attention split over rows on the tensor axis too (each
    device holds an eighth of it, not half); the queries and outputs cross by all-to-all."""
    model, sharded, mesh = models
    verifier_cfg = CFG.replace(num_heads=4, num_kv_heads=2, mask_token_id=None)
    verifier = create_model(verifier_cfg, seed=4)
    graphdef, state = nnx.split(verifier)
    verifier_on_mesh = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    prompts = PROMPTS * 3  # 12 requests: rows refilled (8 rows: in the loop, by generate)
    for rows, scan, spec in ((4, False, P("data")), (8, True, P(("data", "tensor")))):
        options = DecodeOptions("verify", 4, compute=ComputeOptions(matmul_form="plain"), memory=MemoryLayout(scan_layers=scan))
        want = Decoder(model, [1], options, verifier=verifier).generate(prompts, NEW).output_ids
        decoder = Decoder(sharded, [1], options, verifier=verifier_on_mesh, mesh=mesh)
        got = {}
        for event in decoder.stream(prompts, NEW, batch_size=rows):
            if event.output is not None:
                got[event.index] = event.output.output_ids
        assert [got[i] for i in range(len(prompts))] == want, rows
        if rows == 8:  # the one-call program too (its loop state lies as propagation puts it)
            assert decoder.generate(prompts, NEW, batch_size=rows).output_ids == want
        hlo = _chunk_program(decoder).as_text()
        found = collectives(hlo)
        if rows == 4:  # rows over data alone: the heads whole on each tensor device
            assert {op for op, _, _ in found} == {"all-reduce"}, found
        else:  # two all-to-alls a layer, of the step's queries and outputs [rows, W, heads, Dh]
            assert {op for op, _, _ in found} == {"all-reduce", "all-to-all"}, found
            moved = [c for c in found if c[0] == "all-to-all"]
            assert len(moved) == 2, moved  # the scanned layer's body, once
            width = step_shape(options)[0] + 1
            assert all(np.prod(shape) <= rows * width * verifier_cfg.num_heads * CFG.head_dim
                       for _, _, shape in moved), moved
        buffers = _chunk_program(decoder).output_shardings.verifier_cache
        assert all(s.spec == spec for s in jax.tree.leaves(buffers)), buffers
        # admission prefills each row in its own block of rows (8 with the verifier split over
        # rows, tests/decoding/test_admission.py): no cache crosses devices, only the verifier prefill's
        # queries and outputs (each less than one head's slots of one layer of one row)
        assert decoder.admission_shards(rows) == (8 if rows == 8 else 2)
        for settings, admit_hlo in admissions(decoder):
            moved = [c for c in collectives(admit_hlo) if c[0] in GATHERS and c[1] not in ("s32", "pred")]
            assert {op for op, _, _ in moved} <= ({"all-to-all"} if rows == 8 else set()), moved
            assert all(np.prod(shape) < settings.num_slots * CFG.head_dim for _, _, shape in moved), moved
        if rows == 8:  # one row per device [1, both kv heads, every layer, S, Dh]
            assert re.search(r"f32\[1,2,{},\d+,{}\]".format(verifier_cfg.num_layers, CFG.head_dim), hlo)


def test_a_row_split_cache_read_in_chunks_agrees_its_bound_without_a_collective():
    """A long buffer is read a chunk at a time up to the longest row. With the cache split over
    rows on tensor=8 (4 kv heads), that bound taken over each device's rows was a scalar
    all-reduce across the tensor axis in every layer of every step; taken where the rows lie
    whole (here: every device holds every row's length), it needs none."""
    mesh = sharding.make_mesh((1, 1, 8))
    graphdef, state = nnx.split(create_model(CFG, seed=3))
    model = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    decoder = Decoder(model, [1], DecodeOptions("lossless", 4, compute=ComputeOptions(matmul_form="plain")), mesh=mesh)
    assert sharding.kv_rules(CFG.num_kv_heads, 8, mesh) is sharding.ROW_SPLIT_RULES
    hlo = decoder.lower(PROMPTS * 2, NEW, batch_size=8, prompt_width=1024).compile().as_text()
    assert "/while/body/while/body" in hlo  # the chunk loop inside the decode loop
    bounds = [line for line in hlo.splitlines()
              if re.search(r"= s32\[\] all-reduce(-start)?\(", line) and "reduce_max" in line]
    assert not bounds, bounds


def test_rows_round_up_to_split_a_verifier_cache_where_that_holds_less_kv(models):
    """On data=2 x tensor=4 a 2-head verifier's cache splits over rows in multiples of 8. Six
    requested rows become 8 (each device: 1 row of both verifier heads and 4 of one proposer
    head, 96 elements a slot against 3 x 2 + 3 x 1 rows' 144); one row stays 2 (the data axis's
    multiple); ties, paged pools and modes without the verifier keep the requested rows."""
    model, sharded, mesh = models
    verifier = create_model(CFG.replace(num_heads=4, num_kv_heads=2, mask_token_id=None), seed=4)
    verify = Decoder(sharded, [1], DecodeOptions("verify", 4), verifier=verifier, mesh=mesh)
    assert [verify.rows(b, 12) for b in (1, 4, 6, 8, 12)] == [2, 4, 8, 8, 16]
    assert verify.rows(6, 5) == 8  # a row with no request costs less than the whole cache
    assert verify.with_options(DecodeOptions("verify", 4, memory=MemoryLayout(page_size=16))).rows(6, 12) == 6
    assert verify.with_options(DecodeOptions("lossless", 4)).rows(6, 12) == 6
    assert Decoder(model, [1], DecodeOptions("verify", 4), verifier=verifier).rows(6, 12) == 6
    # per device, (row, kv head) pairs: split over rows, over data and heads, or replicated
    assert sharding.kv_per_device(2, 8, mesh) == 2 and sharding.kv_per_device(2, 6, mesh) == 6
    assert sharding.kv_per_device(4, 6, mesh) == 3 and sharding.kv_per_device(4, 5, mesh) == 5


def test_the_tensor_axis_is_the_smallest_kv_head_split_that_fits():
    size = sharding.inference_tensor_size
    # a 32B proposer in bfloat16 (61 GiB of weights; 8 kv heads) on 8 devices: a v5p chip
    # (95 GiB) holds half of it with room to spare, a v6e chip (32 GiB) a quarter
    big = preset("qwen2.5-32b").num_params * 2
    assert size(8, 8, big, 95 * GIB) == 2
    assert size(8, 8, big, 32 * GIB) == 4
    assert size(8, 8, big, 200 * GIB) == 1  # fits one device with room: all data parallel
    assert size(8, 4, big, 16 * GIB) == 4  # short of room: the widest split, if the weights fit at all
    assert size(8, 6, big, 32 * GIB) == 2  # only divisors of the device count too
    assert size(8, 8, big, None) == 1  # memory unknown: data parallel, as before
    with pytest.raises(sharding.MeshError, match=r"do not fit 8 devices of 4\.0 GiB even split 8 ways"):
        size(8, 8, big, 4 * GIB)

    # the mesh over the 8 simulated devices, with a fake budget per device
    small = CFG.num_params * 4
    mesh = sharding.inference_mesh([CFG], "float32", device_bytes=2 * small)
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    mesh = sharding.inference_mesh([CFG], "float32", device_bytes=small // 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    # a verifier's weights count too; bfloat16 halves them
    mesh = sharding.inference_mesh([CFG, CFG], "bfloat16", device_bytes=small)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert sharding.inference_mesh([CFG], devices=jax.devices()[:1]) is None

    # a cache splits over rows on the tensor axis only where tensor cannot split its kv heads
    # and data x tensor splits its rows
    mesh = sharding.make_mesh((2, 1, 4))
    assert sharding.kv_rules(2, 8, mesh) is sharding.ROW_SPLIT_RULES
    assert sharding.kv_rules(2, 4, mesh) is sharding.DEFAULT_RULES  # 4 rows over 8 devices
    assert sharding.kv_rules(4, 8, mesh) is sharding.DEFAULT_RULES  # the heads split
    assert sharding.kv_rules(2, 8, sharding.make_mesh((8, 1, 1))) is sharding.DEFAULT_RULES
    assert sharding.kv_rules(2, 8) is sharding.DEFAULT_RULES  # no ambient mesh


def test_the_tensor_axis_grows_until_the_weights_and_the_kv_cache_fit():
    """The cache of the rows decoded splits over every device whatever the tensor size; only the
    weights' share shrinks. A 32B proposer in bfloat16 at 64 rows x 8k on v6e-8: 15.3 GiB of
    weights and 16 GiB of KV per chip at tensor=4 (over 31.25 GiB), 7.6 + 16 at tensor=8."""
    size, kv_bytes = sharding.inference_tensor_size, sharding.kv_cache_bytes
    big_cfg = preset("qwen2.5-32b")
    big = big_cfg.num_params * 2
    kv = kv_bytes([big_cfg], 64, 8192, "bfloat16")
    assert kv == 2 * 64 * 8 * 128 * 2 * 64 * 8192  # K and V x layers x kv heads x head dim x bf16, per slot
    v6e = int(31.25 * GIB)
    assert size(8, 8, big, v6e) == 4 and size(8, 8, big, v6e, kv_bytes=kv) == 8
    assert size(8, 8, big, v6e, kv_bytes=kv // 4) == 4  # 16 rows: tensor=4 holds them
    assert size(8, 8, big, 95 * GIB, kv_bytes=kv) == 2  # a v5p chip holds both at tensor=2

    # the tiny model on the 8 simulated devices, weights W = 124544 bytes, 512 bytes of KV a slot:
    # 8 rows x 256 slots put W + 1.05 W per device at tensor=1, over 0.9 x 2 W; 0.5 W + 1.05 W at 2
    small = CFG.num_params * 4
    assert (small, kv_bytes([CFG], 1, 1)) == (124544, 512)
    assert size(4, 8, small, 2 * small, kv_bytes=kv_bytes([CFG], 8, 64)) == 1
    assert size(4, 8, small, 2 * small, kv_bytes=kv_bytes([CFG], 8, 256)) == 2
    mesh = sharding.inference_mesh([CFG], "float32", device_bytes=2 * small, kv_bytes=kv_bytes([CFG], 8, 256))
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}


def test_the_default_mesh_is_sized_for_the_kv_cache_generate_will_hold(monkeypatch):
    """parse_mesh (generate's default mesh) passes the KV cache of the rows x slots it is given
    to the mesh rule, so a batch whose cache does not fit beside the weights gets more tensor."""
    small = CFG.num_params * 4
    monkeypatch.setattr(sharding, "device_memory", lambda devices: 2 * small)
    assert dict(parse_mesh(None, [CFG]).shape)["tensor"] == 1
    assert dict(parse_mesh(None, [CFG], kv_shape=(8, 64)).shape)["tensor"] == 1
    assert dict(parse_mesh(None, [CFG], kv_shape=(8, 256)).shape)["tensor"] == 2


def test_build_decoder_picks_the_inference_mesh_and_an_explicit_mesh_wins(tmp_path, monkeypatch, one_device):
    path = str(tmp_path / "ckpt")
    save_model(path, create_model(CFG, seed=3))
    # this machine's memory holds the tiny model many times: every device on data, as before
    assert dict(parse_mesh(None, [CFG]).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    monkeypatch.setattr(sharding, "device_memory", lambda devices: CFG.num_params * 4 // 2)
    decoder, _ = build_decoder(path, DecodeOptions("lossless", 4))
    assert dict(decoder.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert flat_params(decoder.state)["layers.0.attn.k_kernel"].addressable_shards[0].data.shape == (1, 8, 32)
    assert _stream(decoder) == one_device
    decoder, _ = build_decoder(path, DecodeOptions("ar"), mesh_shape="4,1,2")
    assert dict(decoder.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    # weights that fit no split of the kv heads are refused before any is read
    monkeypatch.setattr(sharding, "device_memory", lambda devices: 1024)
    with pytest.raises(DecodeError, match=r"the weights \(0\.0 GiB\) do not fit 8 devices .* split 4 ways"):
        build_decoder(path, DecodeOptions("ar"))
