"""Decoding with the layers as one `lax.scan` (`DecodeOptions(scan_layers=True)`).

The Decoder stacks each layer weight once (`qwen2.stack_layers`) and the KV cache is one
[B, K, L * S, Dh] buffer carried through the scan, each layer writing its step's slots in place
(or [B, K, Dh, L * S], slots minor, as a TPU holds a large one of a head dim under 128 lanes:
forced here with `ComputeOptions(kv_slots_minor=True)`, so that both layouts run on CPU).
Checked here: the output equals the unrolled program's token for token in every mode (and
lossless equals AR), on the batch and the stream paths; the loop never copies the stacked
cache; the compiled program does not grow with depth; on a tensor mesh nothing is gathered.
"""

import dataclasses
import importlib.util
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from prove_jax.decoding import DecodeOptions, Decoder, ComputeOptions, LosslessRule, MemoryLayout
from prove_jax.decoding.program import cache_slots
from prove_jax.models import sharding
from prove_jax.models.params import create_model, flat_params
from prove_jax.models.qwen2 import LayerStack, stack_layers, unstack_layers
from tests.decoding.test_decode_in_place import CFG as SMALL, moves_of_shape
from tests.decoding.test_inference_mesh import CFG as MESH_CFG, NEW, PROMPTS, collectives

# three layers: no cache dimension (L, K = 2, rows) is confused with another
CFG = SMALL.replace(num_layers=3)
# the scan changes the forward, not the step: ar (one-token writes), lossless (the widest
# step) and verify (a second, stacked model) cover its shapes
MODES = {
    "ar": DecodeOptions("ar"),
    "lossless": DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)),
    "verify": DecodeOptions("verify", 3),
}


def scanned(options: DecodeOptions, slots_minor: bool | None = None) -> DecodeOptions:
    """`options` with the layers scanned; `slots_minor`: the stacked cache's layout forced."""
    compute = dataclasses.replace(options.compute, kv_slots_minor=slots_minor)
    return dataclasses.replace(options, compute=compute,
                               memory=dataclasses.replace(options.memory, scan_layers=True))


# the slots-minor cache (TPU's at large sizes) where the checks are dearest: lossless (== AR, and
# the stream's admissions) and verify (two stacked caches); AR keeps this CPU's layout
SLOTS_MINOR = {"ar": None, "lossless": True, "verify": True}


@pytest.fixture(scope="module")
def models():
    return create_model(CFG, seed=0), create_model(CFG.replace(num_layers=2, mask_token_id=None), seed=1)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.RandomState(n)
    return [rng.randint(2, 90, k).tolist() for k in np.resize([3, 9, 5, 12], n)]


def test_stacked_weights_are_the_layers_weights_and_unstack_gives_them_back(models):
    model = models[0]
    stacked = stack_layers(model)
    assert isinstance(stacked.layers, LayerStack) and stacked.layers_stacked and not model.layers_stacked
    q = stacked.layers.layer.attn.q_kernel
    assert q[...].shape == (CFG.num_layers,) + model.layers[0].attn.q_kernel[...].shape
    assert q.logical_axes == ("layers", "heads", "head_dim", "embed")
    for i, layer in enumerate(model.layers):
        np.testing.assert_array_equal(q[...][i], layer.attn.q_kernel[...])
    back = flat_params(unstack_layers(stacked))
    want = flat_params(model)
    assert back.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(want[name]), err_msg=name)


@pytest.mark.parametrize("mode", list(MODES))
def test_scanned_decode_equals_the_unrolled_program_token_for_token(models, mode):
    proposer, verifier = models
    options = MODES[mode]
    kwargs = dict(verifier=verifier) if mode == "verify" else {}
    unrolled = Decoder(proposer, [1], options, **kwargs)
    scan = Decoder(proposer, [1], scanned(options, SLOTS_MINOR[mode]), **kwargs)
    prompts = _prompts(5)
    # 2 rows serving 5 requests: rows are refilled (admission prefill) inside the loop
    want = unrolled.generate(prompts, 24, batch_size=2)
    got = scan.generate(prompts, 24, batch_size=2)
    # the stacked cache is held as forced: [2 rows, K, Dh, L * S] slots minor
    (program,) = [c.as_text() for _, c in scan.programs("run")]
    held = [int(n) for n in re.findall(
        r"f32\[2,{},{},(\d+)\]".format(CFG.num_kv_heads, CFG.head_dim), program)]
    assert any(n >= 16 * CFG.num_layers and n % CFG.num_layers == 0 for n in held) \
        == bool(SLOTS_MINOR[mode]), (mode, held)
    assert got.output_ids == want.output_ids
    np.testing.assert_array_equal(got.forwards, want.forwards)
    np.testing.assert_array_equal(got.accept_hist, want.accept_hist)
    if mode == "lossless":  # and lossless is still AR
        assert got.output_ids == Decoder(proposer, [1], DecodeOptions("ar")).generate(prompts, 24).output_ids
    if mode != "lossless":  # the stream's programs run the same forward in every mode
        return
    # the stream's programs (batched admission, chunks of steps) on the stacked cache
    streamed = {}
    for event in scan.stream(prompts, 24, batch_size=2, chunk_steps=3):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(prompts))] == want.output_ids


def test_with_options_moves_the_weights_between_layouts(models):
    proposer = models[0]
    scan = Decoder(proposer, [1], scanned(MODES["ar"]))
    assert scan.graphdef != Decoder(proposer, [1], MODES["ar"]).graphdef
    back = scan.with_options(MODES["lossless"])
    assert not nnx.merge(back.graphdef, back.state).layers_stacked
    assert back.generate(_prompts(2), 16).output_ids == scan.generate(_prompts(2), 16).output_ids


@pytest.mark.parametrize("mode,new_tokens,slots_minor",
                         [("ar", 40, False), ("lossless", 40, True), ("lossless", 500, False)],
                         ids=["ar", "lossless-slots-minor", "lossless-chunked-read"])
def test_the_scanned_loop_never_copies_the_stacked_cache(models, mode, new_tokens, slots_minor):
    """Each layer writes its step's slots into the carried buffer and reads its own layer: no
    copy of the [B, K, L * S, Dh] buffer (or [B, K, Dh, L * S], held slots minor), nor of one
    layer's [B, K, S, Dh], inside the loop (a cache passed through the scan as xs/ys would be
    rebuilt on every step). This CPU holds it [.., L * S, Dh] unless forced."""
    options = scanned(MODES[mode], slots_minor=True if slots_minor else None)
    decoder = Decoder(models[0], [1], options)
    result = decoder.generate(_prompts(4), new_tokens, batch_size=2)
    assert all(len(out) > 0 for out in result.output_ids)
    ((_, compiled),) = decoder.programs("run")
    hlo = compiled.as_text()
    slots = cache_slots(decoder.buffer_len(16, new_tokens) + {"ar": 1, "lossless": 10}[mode])
    # every layer's slots, one axis (minor where the cache is held so)
    held = ((CFG.head_dim, CFG.num_layers * slots) if slots_minor
            else (CFG.num_layers * slots, CFG.head_dim))
    stacked = (2, CFG.num_kv_heads) + held
    assert "f32[{},{},{},{}]".format(*stacked) in hlo  # the shape looked for is the cache's
    for shape in (stacked, stacked[:2] + stacked[:1:-1]):  # as held, and turned
        assert not moves_of_shape(hlo, shape)
    assert not moves_of_shape(hlo, (2, CFG.num_kv_heads, CFG.head_dim, slots))
    assert not moves_of_shape(hlo, (2, CFG.num_kv_heads, slots, CFG.head_dim))


def _program_size(model, options) -> int:
    lowered = Decoder(model, [1], options).lower([[2, 3, 4]], 8)
    return len(lowered.as_text().splitlines())


def test_the_scanned_program_does_not_grow_with_depth():
    """One layer's code whatever the depth: the lowered program at 6 layers is the size of
    the one at 2 (the unrolled one grows by a layer's code per layer)."""
    sizes = {}
    for layers in (2, 6):
        model = create_model(CFG.replace(num_layers=layers), seed=0)
        sizes[layers] = (_program_size(model, scanned(MODES["lossless"])),
                         _program_size(model, MODES["lossless"]))
    (scan2, unrolled2), (scan6, unrolled6) = sizes[2], sizes[6]
    assert unrolled6 > 1.5 * unrolled2, sizes
    assert scan6 == scan2, sizes


def test_scanned_decode_on_a_tensor_mesh_gathers_nothing_and_equals_one_device():
    """data=2 x tensor=4 over 8 CPU devices: the stacked weights and cache lie split over their
    kv heads (the "layers" axis whole), the chunk program holds no all-gather, and its
    all-reduces are one layer's (2) plus the embedding lookup's: the scan body is compiled once."""
    model = create_model(MESH_CFG, seed=3)
    mesh = sharding.make_mesh((2, 1, 4))
    graphdef, state = nnx.split(model)
    on_mesh = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    options = DecodeOptions("lossless", 4, memory=MemoryLayout(scan_layers=True), compute=ComputeOptions(matmul_form="plain"))
    want = Decoder(model, [1], DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids
    decoder = Decoder(on_mesh, [1], options, mesh=mesh)
    q = nnx.merge(decoder.graphdef, decoder.state).layers.layer.attn.q_kernel[...]
    assert q.addressable_shards[0].data.shape == (MESH_CFG.num_layers, 2, 8, 32)
    streamed = {}
    for event in decoder.stream(PROMPTS, NEW, batch_size=4):
        if event.output is not None:
            streamed[event.index] = event.output.output_ids
    assert [streamed[i] for i in range(len(PROMPTS))] == want
    assert decoder.generate(PROMPTS, NEW, batch_size=2).output_ids == want
    (compiled,) = [c for key, c in decoder.programs("chunk")]
    found = collectives(compiled.as_text())
    assert {op for op, _, _ in found} == {"all-reduce"}, found
    hidden = [c for c in found if c[1] == "f32" and MESH_CFG.hidden_size in c[2]]
    assert len(hidden) == 2 + 1, found
    out = compiled.output_shardings.cache
    assert out.k.spec == P("data", "tensor") and out.v.spec == P("data", "tensor")


def test_a_stacked_model_is_for_decoding_only(models):
    stacked = stack_layers(models[0])
    tokens = np.zeros((1, 4), np.int32)
    mask = np.tril(np.ones((1, 4, 4), bool))
    with pytest.raises(ValueError, match=re.escape("stacked layers")):
        stacked(tokens, np.arange(4)[None], mask)


def _loop_level_lines(hlo: str) -> list[str]:
    """Instructions of the while bodies and conditions themselves (not inside fusions): what a
    decode step materialises in memory."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = comps.setdefault(m.group(1), [])
        elif cur is not None:
            cur.append(line)
    todo = re.findall(r"\bwhile\(.*body=%?([\w.\-]+)", hlo)
    seen, lines = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        lines += comps[name]
        for line in comps[name]:
            todo += re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [x.strip().lstrip("%") for x in group.split(",")]
    return lines


def _materialised(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Arrays of `shape` (size-1 dims ignored) a loop body writes: fusions, copies, slices."""
    want = sorted(shape)
    return [line.strip()[:160] for line in _loop_level_lines(hlo)
            for m in [re.search(r"= (?:bf16|f32)\[([0-9,]+)\]\S* (?:fusion|copy|dynamic-slice|slice|transpose)\(", line)]
            if m and sorted(int(d) for d in m.group(1).split(",") if int(d) != 1) == want]


# weights large enough to be matmuls of their own, not loops fused with their slice
WIDE = CFG.replace(hidden_size=256, intermediate_size=1024)


def test_on_cpu_the_scan_copies_each_layers_weights_per_step():
    """Why scan_layers is off by default: XLA:CPU's matmuls take whole buffers, so each step
    slices every layer's weights out of the stack into a copy (benchmarks/decode_compile.md).
    Also the control that `_materialised` finds a copy where there is one."""
    model = create_model(WIDE, seed=0)
    hlo = Decoder(model, [1], scanned(MODES["ar"])).lower([[2, 3, 4]], 8).compile().as_text()
    assert _materialised(hlo, (WIDE.intermediate_size, WIDE.hidden_size))
    unrolled = Decoder(model, [1], MODES["ar"]).lower([[2, 3, 4]], 8).compile().as_text()
    assert not _materialised(unrolled, (WIDE.intermediate_size, WIDE.hidden_size))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (docs/environment.md)")
def test_on_tpu_the_scan_reads_each_layers_weights_in_place():
    """Compiled for a v6e chip, the scanned step's matmuls read the stacked weights at the
    layer's offset: no weight is sliced into a copy inside the loop."""
    from prove_jax.aot import topology_mesh
    cfg = WIDE.replace(dtype="bfloat16", param_dtype="bfloat16")
    mesh, _ = topology_mesh("v6e", (1, 1, 1), ("data", "fsdp", "tensor"))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: stack_layers(create_model(cfg, seed=0))))
    placed = sharding.state_shardings(state, mesh)
    state = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s)),
                         state, placed, is_leaf=lambda x: isinstance(x, nnx.Variable))
    options = scanned(DecodeOptions("ar", compute=ComputeOptions(platform="tpu", matmul_form="plain")))
    decoder = Decoder(nnx.merge(graphdef, state), [1], options, mesh=mesh)
    hlo = decoder.lower([[2, 3, 4]], 8).compile().as_text()
    assert "while" in hlo and f"bf16[{cfg.num_layers},{cfg.intermediate_size},{cfg.hidden_size}]" in hlo
    assert not _materialised(hlo, (cfg.intermediate_size, cfg.hidden_size))


def test_generate_takes_scan_layers_and_attention_flags():
    from prove_jax.cli import generate
    options = generate.decode_options(generate.parse_args(["--prompt", "x", "--scan-layers", "--attention", "pallas_tpu"]))
    assert options.memory.scan_layers and options.compute.attention == "pallas_tpu"
    default = generate.decode_options(generate.parse_args(["--prompt", "x"]))
    # "auto" until the Decoder resolves it on the host: the XLA path on this CPU
    assert not default.memory.scan_layers and default.compute.resolve_attention().attention == "xla"
