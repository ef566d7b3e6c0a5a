"""The compiled decode program as module-level functions: prefill, admission, the loop body,
the loop, and `run_program`, which `Decoder` jits once per `ProgramSettings`.

Prefill and the whole generation run inside one `jax.lax.while_loop`; the host only sees the
final buffers. A call may queue more requests than the batch has rows: a finished row takes
the next one inside the loop (continuous batching, see queue.py). Model state is split once
(`nnx.split`) and passed as a traced argument, so one compiled program serves every call of
its shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from prove_jax.decoding import mode_steps, queue
from prove_jax.decoding.layouts import LosslessLayout, propose_layout
from prove_jax.decoding.options import DecodeOptions
from prove_jax.decoding.queue import QueueState, Requests
from prove_jax.decoding.sampling import Sampler
from prove_jax.decoding.state import LoopState, initial_state
from prove_jax.models.attention import KVCache, StepMask, causal_mask
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.models import paged
from prove_jax.models.paged import PagedKVCache, data_shards, pages_needed, pooled
from prove_jax.models.sharding import (
    DEFAULT_RULES,
    KV_CACHE_AXES,
    constrain,
    kv_rules,
    rows_per_device,
)
from prove_jax.models.tokens import readable_tokens


@dataclasses.dataclass(frozen=True)
class ProgramSettings:
    """The static side of one decode program: all but the weights and the requests."""

    options: DecodeOptions
    """Validated options for this batch size (after adaptive.adapt_for_batch)."""
    num_rows: int
    """B: rows decoded at once; the queue may hold more requests."""
    num_slots: int
    """N: token slots per row (prompt width plus new tokens, rounded up)."""
    pad_id: int
    """Fills token slots no prompt or output holds."""
    mask_id: int
    """The proposer's <|mask|> token; -1 without one (ar only)."""
    prefill_chunk: int
    """Prompt tokens per prefill forward."""
    sampler: Sampler | None = None
    """What sampling this program does; None: greedy only (no distributions carried)."""
    num_pages: int = 0
    """Pages of the paged KV pools (options.memory.page_size; the verifier's pool has as many, on
    the same page table); 0: contiguous buffers."""
    compute: ComputeOptions = dataclasses.field(init=False)
    """`options.compute` resolved on the host when the settings are made
    (`ComputeOptions.resolve`): what the program's trace reads, so that it never asks for the
    backend. Part of the key, which so holds exactly what the trace reads."""

    def __post_init__(self):
        object.__setattr__(self, "compute", self.options.compute.resolve())


def step_shape(options: DecodeOptions) -> tuple[int, int]:
    """(tokens one step feeds the proposer, drafts carried between steps) for validated options."""
    if options.mode == "lossless":
        layout = LosslessLayout.build(options.block_size, options.lossless.max_groups)
        return layout.width, layout.num_drafts
    return propose_layout(options.block_size)[0], 1


# bf16 rows in one (16, 128) TPU tile: a contiguous cache whose slots (a stacked one's L * S)
# were not a whole number of them was laid out another way and copied whole in every layer of
# every step (the 7B's 28 layers at AR and verify widths: benchmarks/decode_step_cost.md)
CACHE_SLOT_TILE = 16


def cache_slots(slots: int) -> int:
    """Slots a contiguous cache that must hold `slots` (a row's buffer and one step past it) is
    allocated with: `slots` rounded up to whole tiles (CACHE_SLOT_TILE). A paged pool's pages
    are whole tiles already."""
    return -(-slots // CACHE_SLOT_TILE) * CACHE_SLOT_TILE


def decode_step(options: DecodeOptions, model, state: LoopState, *, mask_id: int, verifier=None,
                head=None, sampler: Sampler | None = None,
                compute: ComputeOptions) -> LoopState:
    """One step of the decode loop for validated `options` (`ar` is threshold with K=1), computed
    as `compute`: `options.compute` resolved on the host (`ComputeOptions.resolve`), so that the
    trace never asks for the backend."""
    block_size = options.block_size
    if options.mode == "lossless":
        layout = LosslessLayout.build(block_size, options.lossless.max_groups)
        return mode_steps.lossless_step(
            model,
            state,
            layout=layout,
            mask_id=mask_id,
            compute=compute,
            sampler=sampler,
            relaxed_p=options.lossless.relaxed_p,
        )
    if options.mode == "verify":
        return mode_steps.verify_step(
            model,
            verifier,
            state,
            block_size=block_size,
            mask_id=mask_id,
            rule=options.verify.commit_rule,
            tau_v=options.verify.tau_v,
            head=head,
            head_threshold=options.verify.head_threshold,
            compute=compute,
            sampler=sampler,
            gate=(None if options.verify.gate_tau is None
                  else (options.threshold.confidence, options.verify.gate_tau)),
        )
    return mode_steps.threshold_step(
        model,
        state,
        block_size=block_size,
        mask_id=mask_id,
        tau=options.threshold.tau,
        conf_kind=options.threshold.confidence,
        compute=compute,
        sampler=sampler,
    )


def prefill(
    model,
    prompts: jax.Array,
    prompt_len: jax.Array,
    size: int,
    *,
    chunk_size: int,
    pad_id: int,
    compute: ComputeOptions = DEFAULT_COMPUTE,
    cache: PagedKVCache | None = None,
    layout_rows: int | None = None,
) -> KVCache | PagedKVCache:
    """A cache of `size` slots holding the KV of `prompts` [R, P] (row r's first prompt_len[r]);
    with `cache`, a paged pool with these rows' pages allocated, written there instead. A new
    contiguous cache is held as one of `layout_rows` rows would be (default R: the batch's, that
    admitted rows join: `KVCache.zeros`).

    Written `chunk_size` tokens at a time up to the longest prompt of these rows, so prefill
    costs what the prompts are long, not the prompt width P of the whole call.
    """
    rows, width = prompts.shape
    chunk = min(width, chunk_size)
    prompts = jnp.pad(prompts, ((0, 0), (0, -width % chunk)), constant_values=pad_id)
    causal = causal_mask(1, chunk)

    def write_chunk(i, cache):
        start = i * chunk
        tokens = jax.lax.dynamic_slice_in_dim(prompts, start, chunk, axis=1)
        positions = start + jnp.broadcast_to(
            jnp.arange(chunk, dtype=jnp.int32)[None], (rows, chunk)
        )
        # Real tokens see the earlier chunks and the causal part of this one; keys past a
        # prompt's end are padding, hidden. (Padding queries see garbage: their KV lies past the
        # prompt and decoding overwrites it.)
        valid = positions[:, None, :] < prompt_len[:, None, None]
        mask = StepMask(jnp.full((rows,), start, jnp.int32), causal & valid)
        if pad_id >= model.cfg.vocab_size:  # past a verifier's rows (prompt ids: checked)
            tokens = readable_tokens(tokens, model.cfg.vocab_size)[0]
        return model.hidden_states(tokens, positions, mask, cache, compute=compute)[1]

    n_chunks = (jnp.max(prompt_len) + chunk - 1) // chunk
    return jax.lax.fori_loop(
        0, n_chunks, write_chunk,
        model.new_cache(rows, size, compute=compute, layout_rows=layout_rows) if cache is None
        else cache
    )


def start_rows(model, verifier, requests: Requests, settings: ProgramSettings,
               pool: PagedKVCache | None = None, home: jax.Array | None = None,
               verifier_pool: PagedKVCache | None = None) -> LoopState:
    """Loop state of the rows serving `requests`, right after their prefill. With a paged KV
    pool (options.memory.page_size) each row's pages are taken from `pool` (None: a new, empty one
    for the batch), from the pool of data shard `home` [R] (None: the batch's own rows); the
    caller makes sure they fit (`first_fitting`). The verifier's KV goes to `verifier_pool`
    (None: a new one), on the same pages (`PagedKVCache.with_pages_of`), or to a new
    contiguous cache where the verifier's is one (`paged.pooled`)."""
    options = settings.options
    width, num_drafts = step_shape(options)
    prompts, prompt_len = requests.prompts, requests.prompt_len
    rows, prompt_width = prompts.shape
    tokens = (
        jnp.full((rows, settings.num_slots), settings.pad_id, jnp.int32)
        .at[:, :prompt_width]
        .set(prompts)
    )
    static = dict(
        chunk_size=settings.prefill_chunk, pad_id=settings.pad_id, compute=settings.compute,
        layout_rows=settings.num_rows,
    )
    # room for one step past the buffer: the proposer's step width, the verifier's K
    size = cache_slots(settings.num_slots + width)
    page = options.memory.page_size
    if page is None:
        cache = prefill(model, prompts, prompt_len, size, **static)
    else:
        if pool is None:
            pool = PagedKVCache.zeros(model.cfg, rows, -(-size // page), settings.num_pages, page,
                                      stacked=model.layers_stacked)
        pool = pool.allocate(pages_needed(prompt_len, requests.max_new, page), home)
        cache = prefill(model, prompts, prompt_len, size, cache=pool, **static)
    verifier_cache = None
    if verifier is not None:
        # a verifier whose cache splits over rows, or whose heads a pool would copy, keeps a
        # contiguous one (paged.pooled); the batch's start decides, an admission follows it
        if verifier_pool is None and page is not None:
            contiguous = not pooled(verifier.cfg, rows, settings.compute)
        else:
            contiguous = not isinstance(verifier_pool, PagedKVCache)
        if contiguous:
            verifier_pool = None
        else:  # the proposer's pages, in the verifier's own pools
            if verifier_pool is None:
                verifier_pool = PagedKVCache.zeros(
                    verifier.cfg,
                    rows,
                    pool.table.shape[1],
                    settings.num_pages,
                    page,
                    stacked=verifier.layers_stacked,
                )
            verifier_pool = verifier_pool.with_pages_of(pool)
        verifier_cache = prefill(
            verifier,
            prompts,
            prompt_len,
            cache_slots(settings.num_slots + options.block_size),
            cache=verifier_pool,
            **static,
        )
    lossless_sampling = options.mode == "lossless" and settings.sampler is not None
    return initial_state(
        tokens,
        prompt_len,
        requests.max_new,
        requests.stop_ids,
        cache,
        verifier_cache,
        num_drafts=num_drafts,
        block_size=options.block_size,
        pad_id=settings.pad_id,
        record_steps=options.record_steps,
        sampling=requests.sampling,
        draft_vocab=model.cfg.vocab_size if lossless_sampling else 0,
        logprobs=options.logprobs,
    )


def admit(model, verifier, requests: Requests, request: jax.Array, state: LoopState, row: jax.Array,
          settings: ProgramSettings) -> LoopState:
    """One-row loop state of queued request `request` (traced) for batch row `row`, right after
    its prefill (its pages taken from the pool of the row's shard when the KV is paged)."""
    if settings.options.memory.page_size is None:
        return start_rows(model, verifier, requests.one(request), settings)
    home = state.cache.row_homes()[row][None]
    return start_rows(model, verifier, requests.one(request), settings, pool=state.cache, home=home,
                      verifier_pool=state.verifier_cache)


def first_fitting(requests: Requests, settings: ProgramSettings) -> jax.Array | None:
    """bool [B]: which of the batch's first `requests` (one per row) fit the empty paged pools
    of their rows' data shards, taken in order (a prefix); None without a paged pool."""
    page = settings.options.memory.page_size
    if page is None:
        return None
    need = pages_needed(requests.prompt_len, requests.max_new, page)
    return paged.first_fitting(need, settings.num_pages // data_shards(need.shape[0]))


def loop_body(carry: tuple[LoopState, QueueState], *, model, verifier, head, requests: Requests,
              num_live: jax.Array, settings: ProgramSettings) -> tuple[LoopState, QueueState]:
    """Refill finished rows from the queue (when it holds more requests than rows), then step."""
    state, queue_state = carry
    page = settings.options.memory.page_size
    if requests.prompts.shape[0] > settings.num_rows or page is not None:
        admit_request = functools.partial(admit, model, verifier, requests, settings=settings)
        need = None if page is None else pages_needed(requests.prompt_len, requests.max_new, page)
        state, queue_state = queue.refill(state, queue_state, num_live, admit_request, need=need)
    state = decode_step(settings.options, model, state, mask_id=settings.mask_id, verifier=verifier,
                        head=head, sampler=settings.sampler, compute=settings.compute)
    return state.replace(step=state.step + 1), queue_state


def loop_continues(
    carry: tuple[LoopState, QueueState], *, num_live: jax.Array, bound: jax.Array
) -> jax.Array:
    """A row is still decoding or a live request waits, and the safety bound is not reached."""
    state, queue_state = carry
    return (state.step < bound) & (~jnp.all(state.done) | (queue_state.next_request < num_live))


def decode_loop(
    model, verifier, head, requests: Requests, settings: ProgramSettings
) -> tuple[LoopState, QueueState]:
    """Serve the queue of `requests` with settings.num_rows rows.

    Q == num_rows is a plain static batch. Requests after the last one with a budget are
    padding and never admitted.
    """
    num_requests, rows = requests.prompts.shape[0], settings.num_rows
    first = requests.rows(0, rows)
    admitted = first_fitting(first, settings)  # a paged pool may hold only the first few
    if admitted is not None:
        first = first.replace(max_new=jnp.where(admitted, first.max_new, 0))
    state = start_rows(model, verifier, first, settings)
    queue_state = queue.start(num_requests, state, admitted)
    max_new = requests.max_new
    num_live = jnp.max(jnp.where(max_new > 0, jnp.arange(num_requests, dtype=jnp.int32) + 1, 0))
    # every active step commits >= 1 token: a safety bound, never the reason to stop
    bound = jnp.sum(max_new) + num_requests
    body = functools.partial(
        loop_body,
        model=model,
        verifier=verifier,
        head=head,
        requests=requests,
        num_live=num_live,
        settings=settings,
    )
    more = functools.partial(loop_continues, num_live=num_live, bound=bound)
    state, queue_state = jax.lax.while_loop(more, body, (state, queue_state))
    return state, queue.finish(state, queue_state)


def merge_models(*parts):
    """The modules of (graph definition, state) pairs (`nnx.split`), None where a graph
    definition is None (no verifier, no commit head)."""
    return tuple(
        None if graphdef is None else nnx.merge(graphdef, state) for graphdef, state in parts
    )


def run_program(graphdef, verifier_graphdef, head_graphdef, settings: ProgramSettings,
                params, verifier_params, head_params, requests: Requests):
    """The whole decode of a queue: the function `Decoder` jits, with the graph definitions and
    `settings` bound (static) and the model states (`nnx.split`) and requests traced.

    Returns the per-request results (queue.QueueState: tokens, lengths, counters, the optional
    step trace and logprobs) and the loop's step count.
    """
    model, verifier, head = merge_models((graphdef, params), (verifier_graphdef, verifier_params),
                                         (head_graphdef, head_params))
    state, queue_state = decode_loop(model, verifier, head, requests, settings)
    return queue_state, state.step


# ---- the host-driven loop (Decoder.stream) -------------------------------------------------
# The host keeps the queue: between chunks of decode steps it reads which rows finished, hands
# their results out, and admits waiting requests into the free rows in one batched prefill.

def put_shard_rows(full: jax.Array, part: jax.Array, rows: jax.Array, rules=DEFAULT_RULES,
                   axes: tuple | None = None) -> jax.Array:
    """full [B, ...] with part [R, ...] written at batch rows `rows` [R], shard by shard: part's
    R rows come in blocks, block j for rows of shard j of the B rows as the ambient mesh splits
    them under `rules` (the data shards' when R is not a multiple of that split; one block
    without a mesh). A row outside its block's shard (the padding index B) is dropped. Vmapped
    over the shards, with the admitted rows and their indices pinned to the blocks (`axes`: the
    logical axes of full, default rows then replicated), each device writes the rows it holds
    from the admitted rows it computed; indexed by batch row, GSPMD all-gathered the
    admitted rows' caches over the data axis (benchmarks/decode_step_cost.md, `admit`)."""
    b, r = full.shape[0], part.shape[0]
    shards = b // rows_per_device(b, rules)
    # fewer admitted rows than a split over rows has blocks: they come in the data shards' blocks,
    # each handed to every shard of full's within its data shard (full stays split as it lies:
    # laid out by the data shards, the whole batch's row-split verifier cache was all-gathered
    # over tensor on every admission, benchmarks/decode_step_cost.md)
    blocks = shards if r % shards == 0 else b // rows_per_device(b)
    per, width = b // shards, r // blocks
    axes = ("batch", None) + (tuple(axes[1:]) if axes is not None else (None,) * (full.ndim - 1))

    def spread(x):  # [R, ...] -> [shards, width, ...]: block j's rows for full's shards of it
        x = x.reshape((blocks, width) + x.shape[1:])
        return x if blocks == shards else jnp.repeat(x, shards // blocks, axis=0)

    rows = spread(rows)
    local = jnp.where(rows // per == jnp.arange(shards)[:, None], rows % per, per)  # per: dropped
    write = jax.vmap(lambda f, p, i: f.at[i].set(p.astype(f.dtype), mode="drop"))
    local = constrain(local, axes[:2], rules)
    split = full.reshape((shards, per) + full.shape[1:])
    return write(split, constrain(spread(part), axes, rules), local).reshape(full.shape)


def put_admitted(state: LoopState, part: LoopState, rows: jax.Array) -> LoopState:
    """`state` with the admitted rows `part` (in blocks, one per row shard: `put_shard_rows`)
    at batch rows `rows` [R]. Contiguous caches go where their rows lie (`sharding.kv_rules`):
    a cache split over rows on the tensor axis too takes the finer blocks of
    `Decoder.admission_shards` when R is a multiple of them (the admitted rows' cache is split
    so too), else the data shards' blocks (the admitted rows' cache then lies whole on each
    tensor device, which writes the rows it holds). A paged pool is the admitted rows' (their
    prefill wrote into their shards' pools), their page tables put at `rows`."""
    def put(full, new):
        return full if full.ndim == 0 else put_shard_rows(full, new, rows)

    def caches(full, new):
        if full is None or isinstance(full, PagedKVCache):
            return full
        first = jax.tree.leaves(full)[0]
        rules = kv_rules(first.shape[1], first.shape[0])
        return jax.tree.map(
            lambda f, n: put_shard_rows(f, n, rows, rules, KV_CACHE_AXES), full, new
        )

    merged = jax.tree.map(put, state.replace(cache=None, verifier_cache=None),
                          part.replace(cache=None, verifier_cache=None))
    if not isinstance(state.cache, PagedKVCache):
        return merged.replace(cache=caches(state.cache, part.cache),
                              verifier_cache=caches(state.verifier_cache, part.verifier_cache))
    cache = part.cache.replace(table=put(state.cache.table, part.cache.table), home=None)
    verifier_cache = part.verifier_cache
    if isinstance(verifier_cache, PagedKVCache):
        verifier_cache = verifier_cache.with_pages_of(cache)
    else:  # contiguous beside the pool (paged.pooled), or None
        verifier_cache = caches(state.verifier_cache, verifier_cache)
    return merged.replace(cache=cache, verifier_cache=verifier_cache)


def admit_rows(graphdef, verifier_graphdef, settings: ProgramSettings, params, verifier_params,
               state: LoopState, requests: Requests, rows: jax.Array) -> LoopState:
    """Prefill `requests` (R of them, together) and write them into batch rows `rows` [R]. The
    requests come in blocks, one per row shard of the batch (`Decoder.admission_shards`; a
    padding request's row is B), so each is prefilled where its row lies and nothing crosses the
    data axis (`put_admitted`). A paged pool first takes back the pages of every finished row;
    each block's rows take their shard's pages. The host admits only what fits (stream.py)."""
    model, verifier = merge_models((graphdef, params), (verifier_graphdef, verifier_params))
    pool = verifier_pool = None
    if settings.options.memory.page_size is not None:
        state = queue.release_done(state)
        pool, verifier_pool = state.cache, state.verifier_cache
    return put_admitted(state, start_rows(model, verifier, requests, settings, pool=pool,
                                          verifier_pool=verifier_pool), rows)


def run_chunk(graphdef, verifier_graphdef, head_graphdef, settings: ProgramSettings, params,
              verifier_params, head_params, state: LoopState, max_steps: jax.Array,
              stop_when_free: jax.Array, finish: jax.Array) -> LoopState:
    """Up to `max_steps` decode steps of every active row; ends early when all rows are done,
    or, with `stop_when_free` (requests are waiting), as soon as a row is. Rows marked in
    `finish` [B] (the host cancelled them: a stop string) are done before the first step; rows
    already done then (idle, waiting for a request or for free pages) do not end the chunk."""
    state = state.replace(done=state.done | finish)
    idle = jnp.sum(state.done)
    model, verifier, head = merge_models((graphdef, params), (verifier_graphdef, verifier_params),
                                         (head_graphdef, head_params))

    def more(carry):
        state, n = carry
        freed = jnp.sum(state.done) > idle
        return (n < max_steps) & ~jnp.all(state.done) & ~(stop_when_free & freed)

    def body(carry):
        state, n = carry
        state = decode_step(
            settings.options,
            model,
            state,
            mask_id=settings.mask_id,
            verifier=verifier,
            head=head,
            sampler=settings.sampler,
            compute=settings.compute,
        )
        return state.replace(step=state.step + 1), n + 1

    return jax.lax.while_loop(more, body, (state, jnp.int32(0)))[0]


def start_batch(graphdef, verifier_graphdef, settings: ProgramSettings, params, verifier_params,
                requests: Requests) -> LoopState:
    """The loop state of rows serving `requests` (a row with no budget starts done)."""
    model, verifier = merge_models((graphdef, params), (verifier_graphdef, verifier_params))
    return start_rows(model, verifier, requests, settings)
