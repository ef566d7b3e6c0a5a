"""The step-cost report: HBM bytes and FLOPs of one execution of a compiled program, read from
its HLO (`prove_jax.hlo_cost`), for the programs `generate` streams (`decoding.step_report`).

On this CPU: loops are priced at their trip counts (XLA's own cost analysis counts a body
once); a small model's decode step moves what a hand count of its weights and KV says; a
deliberate extra pass over the KV cache shows up in the bytes; the report's arithmetic; no
scanned step copies its stacked cache. With libtpu (optional): the step compiled for a TPU
slice moves what it must, within 1.3x, and copies no cache; the CLI writes the report.
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from prove_jax import aot, hlo_cost
from prove_jax.decoding import DecodeOptions, Decoder, ComputeOptions, LosslessRule, MemoryLayout
from prove_jax.decoding import program, step_report
from prove_jax.decoding.dry_run import SliceRun
from prove_jax.models import attention, sharding
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import create_model

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=64, mask_token_id=255, eos_token_ids=(1,))
ROWS, PROMPT, NEW = 2, 200, 56


def test_loop_bodies_are_priced_at_their_trip_counts():
    """A scan of L trips, each adding row l of x [L, N] to y [N]: a trip reads x[l] and y and
    writes y, 12 N bytes in float32; XLA's cost analysis counts the body once."""
    layers, n = 16, 1 << 16

    def f(x, y):
        return jax.lax.scan(lambda y, row: (y + row, None), y, x)[0]

    compiled = jax.jit(f).lower(jnp.zeros((layers, n)), jnp.zeros((n,))).compile()
    cost = hlo_cost.program_cost(compiled.as_text())
    hand = layers * 12 * n
    assert hand <= cost.bytes <= 1.15 * hand
    assert compiled.cost_analysis()["bytes accessed"] < cost.bytes / 4  # the pitfall this module avoids


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=0)


def _step(model, **options):
    decoder = Decoder(model, [1], DecodeOptions("ar", 1, **options))
    report = step_report.price_programs(decoder, [[3] * PROMPT] * ROWS, NEW, ROWS, chip="H100", programs=("step",))
    return report, report.programs[0]


def _kv_bytes(slots: int) -> int:
    """float32 K and V of every layer, kv head and row over `slots` slots."""
    return 2 * CFG.num_layers * ROWS * CFG.num_kv_heads * slots * CFG.head_dim * 4


def _weight_bytes() -> int:
    d, f, h, k, dh = CFG.hidden_size, CFG.intermediate_size, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    layer = (h + 2 * k) * dh * d + (h + 2 * k) * dh + h * dh * d + 3 * d * f + 2 * d
    return 4 * (CFG.num_layers * layer + d + CFG.vocab_size * d)  # + final norm, LM head (embedding: 2 rows)


def _activation_bytes(tokens: int, tensor: int = 1, itemsize: int = 4) -> int:
    """Each layer's projection outputs written and read once: q, k, v, attention output, gate,
    up, their product (split over tensor); o, down, the residual stream (whole)."""
    h, k, dh, f, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.intermediate_size, CFG.hidden_size
    split = h * dh + k * dh + k * dh + h * dh + f + f + f
    whole = d + d + d
    return CFG.num_layers * tokens * 2 * (split // tensor + whole) * itemsize


def test_the_step_must_move_its_activations():
    """The activation term by hand at the tiny shape: per token and layer, 2304 elements split
    by tensor and 768 whole, each written and read once."""
    assert step_report.activation_bytes(CFG, 2, 1, 4) == _activation_bytes(2) == 4 * 2 * 2 * 3072 * 4
    assert step_report.activation_bytes(CFG, 31, 2, 2) == _activation_bytes(31, 2, 2) == 4 * 31 * 2 * 1920 * 2


def test_activations_a_layer_can_keep_in_vmem_are_left_out(model):
    """A chip whose VMEM holds one layer's activations (written once) need not move them: the
    bound drops them whole there, and counts them whole one byte short of that."""
    decoder = Decoder(model, [1], DecodeOptions("ar", 1))
    _, settings, state = step_report.stream_programs(decoder, [[3] * PROMPT] * ROWS, NEW, ROWS)
    args = (decoder, settings, state, PROMPT + NEW, 1, 1)
    layer = _activation_bytes(ROWS) // (2 * CFG.num_layers)
    counted = step_report.must_move(*args)
    assert counted - step_report.must_move(*args, vmem_bytes=layer) == _activation_bytes(ROWS)
    assert step_report.must_move(*args, vmem_bytes=layer - 1) == counted


def test_a_decode_step_moves_its_weights_and_kv_once(model):
    """One AR step of a small model (layers unrolled, so XLA:CPU reads each weight in place):
    the bytes its HLO moves are the weights, once, and the KV of the buffer (a short buffer is
    read in one pass, so all of it) and the activations, within the scores and softmax (7% here)."""
    report, step = _step(model)
    filled, slots = report.setting["filled"], report.setting["slots"]
    assert filled == PROMPT + NEW
    logits = 2 * ROWS * CFG.vocab_size * 4
    must = _weight_bytes() + _kv_bytes(filled + 1) + _activation_bytes(ROWS) + logits
    assert step.min_hbm_bytes == pytest.approx(must, rel=0.002)  # the report's own hand count
    assert must <= step.hbm_bytes <= 1.12 * (_weight_bytes() + _kv_bytes(slots))
    assert step.flops >= 2 * (_weight_bytes() // 4 - CFG.vocab_size * CFG.hidden_size) * ROWS * 0.9
    assert step.roofline_seconds == pytest.approx(aot.roofline_seconds("H100", step.hbm_bytes, step.flops))


def test_an_extra_pass_over_the_cache_raises_the_bytes(model, monkeypatch):
    """A deliberate extra copy (every layer's cache rewritten whole after its step's write)
    costs at least one more write of the whole cache in the report."""
    _, before = _step(model)
    written = attention.write_step
    monkeypatch.setattr(attention, "write_step", lambda *a, **k: written(*a, **k) * 2)
    report, after = _step(model)
    assert after.hbm_bytes - before.hbm_bytes >= 0.9 * _kv_bytes(report.setting["slots"])


def test_rows_the_mesh_rounds_up_past_the_requests_are_priced(model):
    """One request on four data shards: the stream runs four rows (the rest hold its dummy
    request), and the report's state has all four (it had the requests' two, and run_chunk
    failed to lower: batch 1 on v6e-4)."""
    mesh = sharding.make_mesh((4, 1, 2))
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    decoder = Decoder(sharded, [1], DecodeOptions("ar", 1), mesh=mesh)
    report = step_report.price_programs(decoder, [[3] * PROMPT], NEW, 1, chip="H100", programs=("step",))
    assert report.setting["rows"] == 4 and report.programs[0].hbm_bytes > _weight_bytes() // 2


def test_the_report_writes_json_and_a_table(tmp_path, model):
    report, step = _step(model)
    path = tmp_path / "report.json"
    report.write(str(path))
    record = json.loads(path.read_text())
    (row,) = record["programs"]
    assert row["name"] == "step"
    for key in ("hbm_bytes", "min_hbm_bytes", "flops", "roofline_seconds", "peak_bytes", "collectives"):
        assert key in row
    assert row["waste"] == pytest.approx(row["hbm_bytes"] / row["min_hbm_bytes"], abs=1e-3)
    assert row["roofline_seconds"] == max(row["hbm_bytes"] / 3350e9, row["flops"] / 989e12)
    table = report.table()
    assert "| step |" in table and f"{step.waste:.2f}" in table


def test_counted_loops_without_a_stated_trip_count():
    """libtpu's compiled HLO states no `known_trip_count`: a scan's trips come from its
    condition, `counter < N`; a loop bounded by a traced value gets the caller's count."""
    text = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %x = f32[4] get-tuple-element(%q), index=1
  %y = f32[4] negate(%x)
  ROOT %t = (s32[], f32[4]) tuple(%j, %y)
}

%cond2 (p2: (s32[], f32[4], s32[])) -> pred[] {
  %p2 = (s32[], f32[4], s32[]) parameter(0)
  %i2 = s32[] get-tuple-element(%p2), index=0
  %n2 = s32[] get-tuple-element(%p2), index=2
  ROOT %lt2 = pred[] compare(%i2, %n2), direction=LT
}

ENTRY %main (a: (s32[], f32[4]), b: (s32[], f32[4], s32[])) -> f32[4] {
  %a = (s32[], f32[4]) parameter(0)
  %w = (s32[], f32[4]) while(%a), condition=%cond, body=%body
  %b = (s32[], f32[4], s32[]) parameter(1)
  %w2 = (s32[], f32[4], s32[]) while(%b), condition=%cond2, body=%body
  ROOT %r = f32[4] get-tuple-element(%w), index=1
}
"""
    cost = hlo_cost.program_cost(text, unknown_trips=3)
    assert cost.by_opcode["negate"] == (7 + 3) * 32  # 16 bytes read, 16 written per trip
    assert cost.unknown_loops == 1


def test_a_kernel_costs_what_it_states():
    """A Pallas TPU kernel's compiled custom call carries its pl.CostEstimate in its backend
    config (as libtpu prints it): the call costs those bytes and FLOPs, not its operands (a
    1 GiB pool here, of which the kernel fetches a few pages); one stating none costs its
    operands and result."""
    config = ('backend_config={"flag_configs":[],"custom_call_config":{"body":"TUzvUgFN","cost_estimate":'
              '{"flops":"123","transcendentals":"7","bytes_accessed":"4567","remote_bytes_transferred":"0"},'
              '"needs_layout_passes":true}}')
    text = """HloModule m

ENTRY %main (a: bf16[1,8,65536,1024], q: f32[4,8,16,128]) -> f32[4,8,16,128] {
  %a = bf16[1,8,65536,1024] parameter(0)
  %q = f32[4,8,16,128] parameter(1)
  ROOT %k = f32[4,8,16,128]{3,2,1,0:T(8,128)} custom-call(%a, %q), custom_call_target="tpu_custom_call", CONFIG
}
"""
    cost = hlo_cost.program_cost(text.replace("CONFIG", config))
    assert (cost.bytes, cost.flops) == (4567, 123)
    bare = hlo_cost.program_cost(text.replace(", CONFIG", ""))
    assert bare.bytes == 2 ** 30 + 2 * 4 * 8 * 16 * 128 * 4 and bare.flops == 0
    # libtpu reserves a buffer for a copy to fill with a call that moves nothing itself
    reserve = text.replace("custom-call(%a, %q)", "custom-call()").replace(", CONFIG", "")
    assert hlo_cost.program_cost(reserve.replace("tpu_custom_call", "AllocateBuffer")).bytes == 0


def test_an_async_slice_costs_its_slice():
    """libtpu slices a buffer into VMEM in pieces (`slice-start`, its result tuple holding the
    whole source): each piece costs the bytes it takes, not the source (which counted a 20 MB
    weight five times in a v6e-8 verify step)."""
    line = ("  %s{i} = ((s8[20316160]{{0:T(1024)}}), s8[4194304]{{0:T(1024)S(1)}}, s32[]{{:S(2)}}) "
            "slice-start(%a), slice={{[{lo}:{hi}]}}\n")
    text = ("HloModule m\n\nENTRY %main (a: s8[20316160]) -> s8[4194304] {\n  %a = s8[20316160] parameter(0)\n"
            + "".join(line.format(i=i, lo=i * 4194304, hi=(i + 1) * 4194304) for i in range(4))
            + "  ROOT %d = s8[4194304]{0:T(1024)S(1)} slice-done(%s0)\n}\n")
    assert hlo_cost.program_cost(text).bytes == 4 * 4194304


def test_a_weight_a_nested_fusion_hands_on_is_read_where_it_is_used():
    """libtpu wraps a dot's weight in a nested fusion that only bitcasts it (the LM head of a
    decode step, as the 7B's compiled step has it): the outer fusion's dot reads the whole
    weight, a dynamic-slice of it what it takes. Priced at the nested fusion's own uses (none:
    it is the root), the head went uncounted and the 7B's steps came out ~0.5-1 GiB a chip
    under their weights."""
    text = """HloModule m

%view (w0: bf16[512,256]) -> bf16[512,256] {
  %w0 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %b = bf16[512,256]{1,0:T(8,128)(2,1)} bitcast(%w0)
}

%head (x: bf16[8,256], w: bf16[512,256]) -> f32[8,512] {
  %x = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %w = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(1)
  %f = bf16[512,256]{1,0:T(8,128)(2,1)} fusion(%w), kind=kLoop, calls=%view
  ROOT %c = f32[8,512]{1,0:T(8,128)S(1)} convolution(%x, %f), dim_labels=bf_oi->bf
}

%rows (w1: bf16[512,256], i: s32[]) -> bf16[16,256] {
  %w1 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %g = bf16[512,256]{1,0:T(8,128)(2,1)} fusion(%w1), kind=kLoop, calls=%view
  ROOT %d = bf16[16,256]{1,0:T(8,128)(2,1)} dynamic-slice(%g, %i, %z), dynamic_slice_sizes={16,256}
}

ENTRY %main (a: bf16[8,256], b: bf16[512,256], j: s32[]) -> (f32[8,512], bf16[16,256]) {
  %a = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %b = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(1)
  %j = s32[] parameter(2)
  %h = f32[8,512]{1,0:T(8,128)S(1)} fusion(%a, %b), kind=kOutput, calls=%head
  %r = bf16[16,256]{1,0:T(8,128)(2,1)} fusion(%b, %j), kind=kLoop, calls=%rows
  ROOT %t = (f32[8,512], bf16[16,256]) tuple(%h, %r)
}
"""
    cost = hlo_cost.program_cost(text)
    weight, taken = 512 * 256 * 2, 16 * 256 * 2  # x and the logits lie in VMEM (S(1))
    assert cost.by_opcode["fusion"] == weight + (taken + taken + 4)  # rows: read, written, index
    assert cost.flops == 2 * 8 * 512 * 256


def _stacked_buffers(state) -> list[str]:
    """'dims' text of each stacked cache or pool buffer of a loop state, as HLO prints shapes."""
    leaves = jax.tree.leaves(state.cache.k) + jax.tree.leaves(state.cache.v)
    return sorted({"[" + ",".join(map(str, x.shape)) + "]" for x in leaves})


@pytest.mark.parametrize("page_size,slots_minor", [(None, None), (None, True), (64, None)],
                         ids=["contiguous", "contiguous-slots-minor", "paged"])
def test_a_scanned_step_copies_no_stacked_cache(model, page_size, slots_minor):
    """The scanned step writes its KV into the stacked cache (or paged pool) in place and reads
    a layer's chunks from it: no instruction but the in-place write produces a buffer of the
    whole cache's shape (on libtpu, each layer copied the pool, or its own slice, every step),
    the cache held as this CPU holds it or slots minor (as a TPU holds a large one)."""
    decoder = Decoder(model, [1], DecodeOptions("ar", 1, memory=MemoryLayout(scan_layers=True, page_size=page_size),
                                                compute=ComputeOptions(kv_slots_minor=slots_minor)))
    fns, _, state = step_report.stream_programs(decoder, [[3] * PROMPT] * ROWS, NEW, ROWS)
    assert getattr(state.cache, "slots_minor", False) is bool(slots_minor)
    fn, args = fns["step"]
    cost = hlo_cost.step_cost(fn.lower(*args).compile().as_text())
    whole = [t for t in cost.top if any(dims in t[4] for dims in _stacked_buffers(state))
             and "scatter" not in t[2]]
    assert whole == []
    assert cost.by_opcode.get("copy", 0) < 0.01 * cost.bytes


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
@pytest.mark.parametrize("page_size", [None, 64])
def test_on_tpu_a_layer_reads_its_kv_in_place(page_size):
    """A lossless step (K=6, G=2: 12 tokens, 48 queries a kv head) of 16 rows of 8k on v5p-8, a
    64 MiB layer KV per chip, through the Pallas kernel that `generate` runs on TPU: the
    compiled step copies no cache (the kernel is handed the stacked cache or the pool whole and
    reads its layer's blocks in place), the kernel is priced at the blocks it fetches, and the
    step moves what it must within 1.3x."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=16,
                      num_kv_heads=8, head_dim=128, mask_token_id=1023, eos_token_ids=(1,))
    options = DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(scan_layers=True, page_size=page_size),
                            compute=ComputeOptions(attention="pallas_tpu"))
    report = step_report.step_report(SliceRun(cfg, options, chip="v5p", chips=4, batch=16, context=8192), programs=("step",))
    (step,) = report.programs
    kv_layer = 2 * 4 * cfg.num_kv_heads * 8192 * cfg.head_dim * 2  # K and V of a chip's 4 rows, bf16
    assert step.bytes_by_opcode.get("copy", 0) < 0.01 * step.hbm_bytes
    assert not [t for t in step.largest if t[3] != "custom-call" and t[0] >= kv_layer / 4], step.largest
    kernel = step.bytes_by_opcode["custom-call"]
    assert cfg.num_layers * kv_layer <= kernel <= 1.2 * cfg.num_layers * kv_layer
    assert step.waste <= 1.3


def test_a_stream_allocates_its_caches_in_whole_tiles_of_slots(model):
    """A verify stream's proposer (step width 2K-1 = 15) and verifier (K = 8) caches each hold a
    row's buffer and one step past it, rounded up to whole 16-slot tiles (`program.cache_slots`),
    and the report prices the slots they hold."""
    decoder = Decoder(model, [1], DecodeOptions("verify", 8, memory=MemoryLayout(scan_layers=True)), verifier=model)
    _, settings, state = step_report.stream_programs(decoder, [[3] * PROMPT] * ROWS, NEW, ROWS)
    for cache, past in ((state.cache, 15), (state.verifier_cache, 8)):
        slots = cache.slots_per_layer(CFG.num_layers)
        assert slots % 16 == 0 and 0 <= slots - (settings.num_slots + past) < 16
    assert [program.cache_slots(n) for n in (1, 16, 17, 8193)] == [16, 16, 32, 8208]


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
def test_on_tpu_an_ar_step_of_28_layers_copies_no_cache():
    """28 scanned layers (the 7B's count) at AR on v5e-4, 16 rows of 8k: with each layer's 8193
    slots the stacked cache's 229404 were not whole tiles, libtpu laid it out another way than
    the kernel reads it and copied it whole in every layer of every step (4-20x what the 7B's
    step must move); in whole tiles it copies nothing and moves what it must within 1.3x."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=28, num_heads=16,
                      num_kv_heads=8, head_dim=128, mask_token_id=1023, eos_token_ids=(1,))
    options = DecodeOptions("ar", 1, memory=MemoryLayout(scan_layers=True), compute=ComputeOptions(attention="pallas_tpu"))
    report = step_report.step_report(SliceRun(cfg, options, chip="v5e", chips=4, batch=16, context=8192), programs=("step",))
    (step,) = report.programs
    assert step.bytes_by_opcode.get("copy", 0) < 0.01 * step.hbm_bytes, step.largest
    assert step.waste <= 1.3
    assert report.setting["slots"] % 16 == 0


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (optional): pip install 'libtpu==0.0.42.*'")
def test_generate_dry_run_writes_the_report(tmp_path, capsys):
    """`generate --dry-run SLICE --report FILE`: the programs `generate` streams, as JSON and as
    a table; a report path that is a directory is a one-line error before anything compiles."""
    from prove_jax import assets
    from prove_jax.cli import generate
    path = tmp_path / "report.json"
    common = ["--dry-run", "v5e-4", "--model", assets.DEMO_PROPOSER, "--mode", "ar", "--batch-size", "4",
              "--context", "512", "--max-new-tokens", "64", "--dtype", "bfloat16", "--scan-layers"]
    assert generate.main(common + ["--report", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [p["name"] for p in record["programs"]] == ["step", "prefill", "admit"]
    assert record["chip"] == "v5e" and record["rows"] == 4
    step = record["programs"][0]  # at most 1.3x its weights and live KV (less: a small cache stays in VMEM)
    assert 0.3 <= step["waste"] <= 1.3
    assert step["roofline_seconds"] == pytest.approx(step["hbm_bytes"] / aot.CHIP_HBM_BANDWIDTH["v5e"])
    out = capsys.readouterr().out
    assert "| step |" in out and "| admit |" in out
    assert generate.main(common + ["--report", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
