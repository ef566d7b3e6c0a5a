"""`generate --dry-run SLICE --report FILE`: what each program `generate` runs would cost on
the slice, read from its libtpu compile.

`generate` serves a stream (stream.py): `start_batch` prefills the first rows, `run_chunk` runs
up to `--chunk-steps` decode steps in a `while_loop`, and `admit_rows` prefills requests into
freed rows between chunks. Each is compiled here as stream.py compiles it (donated state,
the state's shardings), with abstract weights on the slice's mesh, and its HLO is walked by
`prove_jax.hlo_cost`: HBM bytes and dot FLOPs of one execution with every loop at its trip
count ("step" is one trip of the chunk's step loop: one decode step). Beside the bytes the
program moves is what a step must move (`min_hbm_bytes`): each weight once, each row's live
KV once, the new KV, the step's activations, the logits. Their ratio is the waste the compiled
program adds (layout copies, whole-buffer slices); `roofline_seconds`, the time the chip's
bandwidth or peak allows, is what a step would take at best.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax import aot, hlo_cost
from prove_jax.files import atomic_write_text
from prove_jax.decoding import program
from prove_jax.decoding.dry_run import DOES_NOT_FIT_ADVICE, SliceRun, _on_slice
from prove_jax.decoding.program import step_shape
from prove_jax.decoding.stream import state_sharding
from prove_jax.models.attention import cache_chunk
from prove_jax.models.config import ModelConfig
from prove_jax.models.sharding import rows_per_device

TOP_INSTRUCTIONS = 8  # the dearest instructions a report lists per program
# VMEM per TensorCore (JAX's pallas tpu_info): a layer whose activations fit could keep them
# there (libtpu does on v6e-8, see benchmarks/decode_step_cost.md), so must-move leaves them out
CHIP_VMEM_BYTES = {"v5e": 128 * 2 ** 20, "v5p": 64 * 2 ** 20, "v6e": 128 * 2 ** 20}


@dataclasses.dataclass
class ProgramCost:
    """One compiled program, per chip and per execution (one decode step for "step")."""
    name: str
    hbm_bytes: int
    """Bytes its HLO reads and writes in HBM, loops at their trip counts (`hlo_cost`)."""
    min_hbm_bytes: int
    """What it must move: each weight once, the live KV once, the KV it writes, its activations,
    its logits."""
    flops: int
    """FLOPs of its dots (elementwise work left out)."""
    roofline_seconds: float
    peak_bytes: int
    collectives: dict
    compile_seconds: float = 0.0
    assumed_trips: dict = dataclasses.field(default_factory=dict)
    """Trip counts priced for loops bounded by traced values (the compiler states none)."""
    bytes_by_opcode: dict = dataclasses.field(default_factory=dict)
    largest: list = dataclasses.field(default_factory=list)
    """The dearest instructions: [bytes (trips included), computation, instruction, opcode,
    shape]."""

    @property
    def waste(self) -> float:
        """hbm_bytes / min_hbm_bytes: 1 moves nothing it need not."""
        return self.hbm_bytes / max(1, self.min_hbm_bytes)

    def record(self) -> dict:
        return dict(dataclasses.asdict(self), waste=round(self.waste, 3))


@dataclasses.dataclass
class StepReport:
    """The slice, the settings and the cost of each program a stream runs there."""
    setting: dict
    programs: list[ProgramCost]
    does_not_fit: str = ""

    def record(self) -> dict:
        return dict(
            self.setting,
            programs=[p.record() for p in self.programs],
            does_not_fit=self.does_not_fit,
        )

    def write(self, path: str) -> None:
        """The record as JSON at `path` (via a temporary file: never half written)."""
        atomic_write_text(path, json.dumps(self.record(), indent=1) + "\n")

    def table(self) -> str:
        s = self.setting
        gib, mib = aot.GIB, 2 ** 20
        head = (
            f"step cost on {s['topology']} ({s['chips']} x {s['chip']}), mesh {s['mesh']}: "
            f"{s['mode']} K={s['block_size']}, {s['rows']} rows, KV filled to {s['filled']} of "
            f"{s['slots']} slots, {'paged' if s['page_size'] else 'contiguous'} KV, attention "
            f"{s['attention']}; per chip, one execution"
        )
        rows = [
            head,
            "| program | HBM bytes | must move | ratio | GFLOP | roofline | peak | collectives |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in self.programs:
            coll = (
                ", ".join(f"{k} {v['count']}" for k, v in p.collectives.items() if v["count"])
                or "none"
            )
            rows.append(
                f"| {p.name} | {p.hbm_bytes / gib:.3f} GiB | {p.min_hbm_bytes / gib:.3f} GiB | "
                f"{p.waste:.2f} | {p.flops / 1e9:.1f} | {p.roofline_seconds * 1e3:.3f} ms | "
                f"{p.peak_bytes / gib:.2f} GiB | {coll} |"
            )
        if self.does_not_fit:
            rows.append(f"DOES NOT FIT: {self.does_not_fit}")
        for p in self.programs:
            rows.append(
                f"{p.name}: dearest instructions (MiB per execution): "
                + "; ".join(
                    f"{b / mib:.1f} {op} {shape.split('{')[0]}"
                    for b, _, _, op, shape in p.largest[:4]
                )
            )
        return "\n".join(rows)


def _abstract(tree, sharding):
    """ShapeDtypeStructs of `tree` placed by `sharding` (one, a matching tree, or None)."""
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding
        )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _per_chip(x) -> int:
    shape = x.shape if getattr(x, "sharding", None) is None else x.sharding.shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _on_mesh(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def stream_programs(decoder, prompts, new_tokens: int, batch: int):
    """({name: (jitted function, abstract arguments)}, settings, abstract loop state) of the
    programs `Decoder.stream` compiles for these requests, on `decoder.mesh` if it has one:
    "step" (`run_chunk`: its loop's body is one decode step), "prefill" (`start_batch`) and
    "admit" (`admit_rows` of one request per data shard, the smallest admission)."""
    stream = decoder.stream(prompts, new_tokens, batch_size=batch)
    settings, mesh = stream.settings, decoder.mesh
    rows, shards = settings.num_rows, decoder.data_shards()
    batch_sharding = decoder.batch_sharding()
    replicated = None if mesh is None else NamedSharding(mesh, P())
    bound = (decoder.graphdef, decoder.verifier_graphdef)
    start = functools.partial(program.start_batch, *bound, settings)
    admit = functools.partial(program.admit_rows, *bound, settings)
    chunk = functools.partial(program.run_chunk, *bound, decoder.head_graphdef, settings)
    # n requests; rows past the prompts hold the appended dummy (no budget), as the stream
    # starts them (more rows than requests where the rows round up to the data shards)
    requests = lambda n: _abstract(  # noqa: E731
        jax.tree.map(lambda x: x[[min(i, len(x) - 1) for i in range(n)]], stream.requests),
        batch_sharding,
    )
    params, vparams, hparams = (_abstract(s, None) if mesh is None else s for s in
                                (decoder.state, decoder.verifier_state, decoder.head_state))
    with _on_mesh(mesh):
        state = jax.eval_shape(start, params, vparams, requests(rows))
    placed = None if mesh is None else state_sharding(batch_sharding, state)
    state = _abstract(state, placed)
    # noqa: E731
    array = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    jit = functools.partial(jax.jit, out_shardings=placed) if mesh is not None else jax.jit
    return (
        {
            "step": (
                jit(chunk, donate_argnums=(3,)),
                (
                    params,
                    vparams,
                    hparams,
                    state,
                    array((), jnp.int32),
                    array((), jnp.bool_),
                    array((rows,), jnp.bool_),
                ),
            ),
            "prefill": (jit(start), (params, vparams, requests(rows))),
            "admit": (
                jit(admit, donate_argnums=(2,)),
                (params, vparams, state, requests(shards), array((shards,), jnp.int32)),
            ),
        },
        settings,
        state,
    )


def _weights_read(decoder, rows: int, width: int) -> int:
    """Per chip: every weight once, except an untied embedding table, of which a step reads
    the rows its tokens look up."""
    total = 0
    for graphdef_state in (
        (decoder.state, decoder.cfg),
        (decoder.verifier_state, decoder.verifier_cfg),
    ):
        state, cfg = graphdef_state
        if state is None:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            name = jax.tree_util.keystr(path)
            if "embed" in name and "layers" not in name and not cfg.tie_word_embeddings:
                total += rows * width * cfg.hidden_size * jnp.dtype(leaf.dtype).itemsize
            else:
                total += _per_chip(leaf)
    return total


def _cache_bytes(cache) -> int:
    return (
        0
        if cache is None
        else sum(_per_chip(x) for x in (jax.tree.leaves(cache.k) + jax.tree.leaves(cache.v)))
    )


def activation_bytes(cfg: ModelConfig, tokens: int, tensor: int, itemsize: int) -> int:
    """Per chip, what a copy-free forward of `tokens` tokens (this chip's rows) writes and reads
    back between its layers' matmuls: each projection's output written once and read once (q, k,
    v, attention output and gate, up, their product split over `tensor`; o, down and the residual
    stream between layers whole), at the weights' `itemsize`. Norms, scores and softmax are left
    out: a fused program keeps them in VMEM, so this stays a lower bound."""
    split = (cfg.num_heads * 2 + cfg.num_kv_heads * 2) * cfg.head_dim + 3 * cfg.intermediate_size
    whole = 3 * cfg.hidden_size
    return int(2 * cfg.num_layers * tokens * (split / tensor + whole) * itemsize)


def must_move(
    decoder,
    settings,
    state,
    filled: int,
    tokens: int,
    logits_rows: int,
    rows: int | None = None,
    verifier_tokens: int | None = None,
    vmem_bytes: int = 0,
) -> int:
    """Per chip, what a program over `rows` of `state`'s rows (default all) must move: the
    weights once, the KV of `filled` slots of each row read once and `tokens` slots of it
    written (`verifier_tokens` of the verifier's, default `tokens`), the activations of those
    tokens (`activation_bytes`) unless one layer's fit in `vmem_bytes`, and the float32 logits
    of `logits_rows` tokens per row written and read once."""
    rows = settings.num_rows if rows is None else rows
    total = _weights_read(decoder, rows, tokens)
    tensor = 1 if decoder.mesh is None else decoder.mesh.shape.get("tensor", 1)
    chip_rows = max(1, rows // decoder.data_shards())
    verifier_tokens = tokens if verifier_tokens is None else verifier_tokens
    for cache, cfg, state_, width in (
        (state.cache, decoder.cfg, decoder.state, tokens),
        (state.verifier_cache, decoder.verifier_cfg, decoder.verifier_state, verifier_tokens),
    ):
        if cache is None:
            continue
        per_slot = (
            _cache_bytes(cache) / _slots(cache, settings, cfg.num_layers) * rows / settings.num_rows
        )
        total += int(per_slot * (filled + width))
        itemsize = jnp.dtype(jax.tree.leaves(state_)[0].dtype).itemsize
        activations = activation_bytes(cfg, chip_rows * width, tensor, itemsize)
        if activations // (2 * cfg.num_layers) > vmem_bytes:  # one layer's, written once
            total += activations
        vocab = cfg.vocab_size // tensor
        total += 2 * chip_rows * logits_rows * vocab * 4
    return total


def _slots(cache, settings, num_layers: int) -> int:
    """Slots one row's share of `cache` holds: a contiguous buffer's width (a stacked one holds
    every layer's slots on one axis), or a paged pool's pages per row (the pool is sized to hold
    every row's pages)."""
    first = jax.tree.leaves(cache.k)[0]
    if hasattr(cache, "table"):  # a pool: [D, K, (L,) Pl, page, Dh] for rows / D rows each
        return first.shape[-3] * first.shape[-2] // max(1, settings.num_rows // first.shape[0])
    return cache.slots_per_layer(num_layers)


def _kv_chunk_trips(decoder, settings, filled: int, platform: str) -> int:
    """Trips of the chunked KV read (`attention._attend_cached`) at `filled` slots."""
    width, _ = step_shape(settings.options)
    slots = program.cache_slots(settings.num_slots + width)
    with _on_mesh(decoder.mesh):
        size = cache_chunk(slots, rows=rows_per_device(settings.num_rows), platform=platform)
    page = settings.options.memory.page_size or 1
    size = min(slots, -(-size // page) * page)
    return 1 if size >= slots else -(-filled // size)


def step_report(run: SliceRun, programs: tuple[str, ...] = ("step", "prefill", "admit")
                ) -> StepReport:
    """Compile the programs a stream of `run.batch` rows runs on `run`'s TPU slice (needs
    libtpu) and price each from its HLO. The step is priced at rows filled to `context` slots
    (a request's dearest)."""
    dry, decoder, prompt = _on_slice(run)
    chip, batch = run.chip, run.batch
    setting = dict(chip=chip, chips=run.chips, topology=dry.topology, mesh=dry.mesh,
                   proposer_params=dry.proposer_params, verifier_params=dry.verifier_params,
                   weight_bytes=dry.weight_bytes, hbm_capacity=dry.hbm_bytes)
    return price_programs(
        decoder,
        [prompt] * batch,
        run.new_tokens,
        batch,
        chip=chip,
        topology=dry.topology,
        programs=programs,
        setting=setting,
    )


def price_programs(
    decoder,
    prompts,
    new_tokens: int,
    batch: int,
    *,
    chip: str,
    topology: str | None = None,
    programs: tuple[str, ...] = ("step", "prefill", "admit"),
    filled: int | None = None,
    setting: dict | None = None,
) -> StepReport:
    """Compile the stream programs of `decoder` for these requests (for `topology` on a TPU
    slice; None: this host's backend) and price them for `chip`'s bandwidth and peak. The step
    is priced with every row filled to `filled` slots (default: the longest prompt plus
    `new_tokens`)."""
    fns, settings, state = stream_programs(decoder, prompts, new_tokens, batch)
    o = settings.options
    width, _ = step_shape(o)
    prompt_len = max(len(p) for p in prompts)
    filled = prompt_len + new_tokens if filled is None else filled
    platform = "tpu" if topology is not None else jax.default_backend()
    kv_trips = _kv_chunk_trips(decoder, settings, filled, platform)
    prefill_chunks = -(-prompt_len // settings.prefill_chunk)
    setting = dict(
        setting or {},
        chip=chip,
        mode=o.mode,
        block_size=o.block_size,
        groups=o.lossless.max_groups,
        step_width=width,
        scan_layers=o.memory.scan_layers,
        attention=o.compute.attention,
        page_size=o.memory.page_size,
        batch=batch,
        rows=settings.num_rows,
        prompt_tokens=prompt_len,
        new_tokens=new_tokens,
        filled=filled,
        slots=program.cache_slots(settings.num_slots + width),
        hbm_bandwidth=aot.CHIP_HBM_BANDWIDTH[chip],
        peak_flops=aot.CHIP_PEAK_FLOPS[chip],
    )
    setting.setdefault("topology", topology or jax.default_backend())
    setting.setdefault("chips", 1)
    setting.setdefault("mesh", None if decoder.mesh is None else dict(decoder.mesh.shape))
    report = StepReport(setting, [])
    logits_rows = width if o.mode != "verify" else width + o.block_size
    for name in programs:
        fn, args = fns[name]
        with _on_mesh(decoder.mesh):
            lowered = fn.lower(*args)
        try:
            compiled, stats = aot.compile_with_stats(
                lowered, setting["topology"], what=f"the {name} program", advice=DOES_NOT_FIT_ADVICE
            )
        except aot.DoesNotFit as e:
            report.does_not_fit = str(e)
            break
        text = compiled.as_text()
        if name == "step":
            trips = {"kv_chunks": kv_trips}
            cost = hlo_cost.step_cost(text, unknown_trips=kv_trips)
            need = must_move(decoder, settings, state, filled, width, logits_rows,
                             verifier_tokens=o.block_size if o.mode == "verify" else None,
                             vmem_bytes=CHIP_VMEM_BYTES.get(chip, 0))
        else:  # prefill chunks, and inside each the KV read so far (half the prompt on average)
            trips = {"prefill_chunks": prefill_chunks, "kv_chunks": max(1, kv_trips // 2)}
            cost = hlo_cost.program_cost(text, unknown_trips=lambda instr, depth: (
                prefill_chunks if depth == 0 else trips["kv_chunks"]))
            admitted = settings.num_rows if name == "prefill" else decoder.data_shards()
            need = must_move(decoder, settings, state, 0, prompt_len, 1, rows=admitted)
        report.programs.append(
            ProgramCost(
                name=name,
                hbm_bytes=cost.bytes,
                min_hbm_bytes=need,
                flops=cost.flops,
                roofline_seconds=aot.roofline_seconds(chip, cost.bytes, cost.flops),
                peak_bytes=stats.peak_bytes,
                collectives={k: v for k, v in stats.collectives.items() if v["count"]},
                compile_seconds=round(stats.compile_seconds, 1),
                assumed_trips=trips if cost.unknown_loops else {},
                bytes_by_opcode=dict(sorted(cost.by_opcode.items(), key=lambda kv: -kv[1])[:8]),
                largest=[list(t) for t in cost.largest(TOP_INSTRUCTIONS)],
            )
        )
    return report
