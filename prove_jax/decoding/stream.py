"""The host-driven decode loop: `Decoder.stream` yields each request's tokens as they are
committed and its result as soon as it finishes.

Three compiled programs serve a stream (program.py): `start_batch` fills the rows, `run_chunk`
runs up to `chunk_steps` decode steps inside `jax.lax.while_loop` (the state is donated, so the
caches are updated in place between calls), and `admit_rows` prefills the waiting requests
admitted together into the free rows, in one batched forward (compiled for a power-of-two
number of rows per data shard). Between chunks the host reads the rows' lengths, yields the new
tokens, and refills the rows that finished. A chunk ends early when a row finishes while
requests wait, so a row is never left idle for long.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax.decoding import program
from prove_jax.decoding.adaptive import adapt_for_batch
from prove_jax.decoding.options import DecodeError, DecodeOptions
from prove_jax.decoding.program import ProgramSettings
from prove_jax.decoding.queue import Requests
from prove_jax.decoding.sampling import GREEDY, RowSampling, Sampler, SamplingParams
from prove_jax.decoding.state import LoopState
from prove_jax.models.attention import KVCache, cache_axes
from prove_jax.models.paged import PagedKVCache, pool_axes
from prove_jax.models.sharding import activation_sharding, kv_rules
from prove_jax.profiling import StepProfile


@dataclasses.dataclass
class RequestOutput:
    """One finished request."""
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    forwards: int  # proposer forwards while it was decoding
    verifier_forwards: int
    accept_hist: list[int]
    seed: int
    step_commits: list[int] | None = None  # with options.record_steps: tokens per forward
    # with options.logprobs: per token (logprob, [(id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class StreamEvent:
    """Request `index` committed `new_ids` (in `blocks`, tokens per forward, with
    options.record_steps); `output` is set when it finished with this event."""
    index: int
    new_ids: list[int]
    blocks: list[int] | None = None
    output: RequestOutput | None = None


def _to_host(tree):
    """The values of a pytree of (possibly sharded) arrays on this host, copied together; on
    several hosts every process gets all of them."""
    if jax.process_count() > 1:
        return jax.tree.map(
            lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
        )
    return jax.device_get(tree)


def state_sharding(batch: NamedSharding, state: LoopState) -> LoopState:
    """Where each leaf of the (abstract) loop state lies: rows as `batch` splits them, the
    scalars replicated, and the KV caches split over their kv heads too (`KV_CACHE_AXES`;
    contiguous caches whose heads the tensor axis cannot split: over their rows,
    `sharding.kv_rules`), as the model writes them (pinned to the batch axes alone, the caches
    were all-gathered over the tensor axis at the end of every call)."""
    mesh = batch.mesh
    scalar = NamedSharding(mesh, P())
    placed = jax.tree.map(lambda x: batch if x.ndim else scalar, state)

    def cache(c: KVCache | PagedKVCache | None):
        if isinstance(c, PagedKVCache):  # the pools split over kv heads, the table like the rows
            # noqa: E731
            pool = lambda x: activation_sharding(mesh, pool_axes(x.ndim == 6), x.shape)
            return c.replace(
                k=jax.tree.map(pool, c.k), v=jax.tree.map(pool, c.v), table=batch, free=batch
            )
        return None if c is None else jax.tree.map(lambda x: activation_sharding(
            mesh, cache_axes(x.ndim == 5), x.shape, kv_rules(x.shape[1], x.shape[0], mesh)), c)

    return placed.replace(cache=cache(state.cache), verifier_cache=cache(state.verifier_cache))


def _spread(free: list[int], per_shard: int) -> list[int]:
    """Free rows taken round-robin over the row shards (`per_shard` rows each): the first of
    every shard, then the second, ...; an admission's largest block, which sets its compiled
    size, stays small."""
    rank = {r: sum(1 for o in free if o // per_shard == r // per_shard and o < r) for r in free}
    return sorted(free, key=lambda r: (rank[r], r))


def _buckets(rows: int, shards: int = 1) -> list[int]:
    """Admission sizes compiled: `shards` (the batch's data shards) times powers of two below
    `rows`, and `rows`."""
    sizes, b = [], shards
    while b < rows:
        sizes.append(b)
        b *= 2
    return sizes + [rows]


class DecodeStream:
    """Iterate it for `StreamEvent`s; afterwards `seconds` (decode), `compile_seconds`, `chunks`
    and `options` (what ran) describe the run. Made by `Decoder.stream`."""

    def __init__(self, decoder, requests: Requests, seeds: list[int], settings: ProgramSettings,
                 chunk_steps: int, log: Callable[[str], None] | None = None):
        self.decoder = decoder
        self.requests = requests  # host arrays, one dummy request (no budget) appended
        self.seeds = seeds
        self.settings = settings
        self.options: DecodeOptions = settings.options
        self.chunk_steps = chunk_steps
        self.log = log or (lambda msg: None)
        self.seconds = 0.0
        self.compile_seconds = 0.0
        self.chunks = 0
        self.steps = 0  # decode steps run so far (all rows together)
        self._cancelled: set[int] = set()
        self._needs: list[int] | None = None  # paged KV pages of each request (`_placements`)
        self._state_sharding = None

    def cancel(self, index: int) -> None:
        """Finish request `index` now: its next event carries its output as far as it got (its
        row stops before the next chunk's first step)."""
        self._cancelled.add(index)

    # ---- compiled programs ------------------------------------------------------------------

    def _compiled(self, name: str, size: int, fn, args, donate: tuple[int, ...] = ()):
        """The program `name` for `size` requests at once (its other shapes follow settings)."""
        dec = self.decoder
        key = (
            name,
            size,
            self.settings,
            self.requests.prompts.shape[1],
            self.requests.stop_ids.shape[1],
        )

        def build():
            what = {"start": "the first rows' prefill", "chunk": "the decode step",
                    "admit": f"the prefill of {size} admitted request(s)"}[name]
            self.log(f"compiling {what} ...")
            # with a mesh every program returns the state split over the batch axes, as it takes it
            kw = {} if self._state_sharding is None else {"out_shardings": self._state_sharding}
            compiled = jax.jit(fn, donate_argnums=donate, **kw).lower(*args).compile()
            if name == "chunk":
                dec.check_fits(compiled, self.settings.num_rows, self.settings.num_slots)
            return compiled
        compiled, seconds = dec.compile_once(key, build)
        self.compile_seconds += seconds
        return compiled

    # a --profile trace: each chunk of decode steps is one of its steps (prove_jax/profiling.py)
    profile: StepProfile = StepProfile(None, "decode_chunk")

    def _run(self, name: str, size: int, fn, *args, donate: tuple[int, ...] = ()):
        compiled = self._compiled(name, size, fn, args, donate)
        if name != "chunk":
            return compiled(*args)
        with self.profile.step():
            out = compiled(*args)
            if self.profile.active:  # the trace holds the chunk whole
                jax.block_until_ready(out)
        return out

    def _programs(self):
        dec, s = self.decoder, self.settings
        bound = (dec.graphdef, dec.verifier_graphdef)
        start = functools.partial(program.start_batch, *bound, s)
        admit = functools.partial(program.admit_rows, *bound, s)
        chunk = functools.partial(program.run_chunk, *bound, dec.head_graphdef, s)
        return start, admit, chunk

    def _take(self, indices: list[int]) -> Requests:
        sharding = self.decoder.batch_sharding()
        part = jax.tree.map(lambda x: x[np.asarray(indices)], self.requests)
        return part if sharding is None else jax.device_put(part, sharding)

    # ---- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamEvent]:
        dec, s = self.decoder, self.settings
        rows = s.num_rows
        num = len(self.seeds)
        dummy = num  # the appended request with no budget: a row with it starts done
        start_fn, admit_fn, chunk_fn = self._programs()
        params, vparams = dec.state, dec.verifier_state
        waiting = list(range(num))[::-1]  # popped from the end: in order
        serving = [-1] * rows
        for r, i in self._placements(list(range(rows)), waiting, serving):  # all that fit
            serving[r] = i
            waiting.pop()
        with jax.set_mesh(dec.mesh) if dec.mesh is not None else contextlib.nullcontext():
            first = self._take([i if i >= 0 else dummy for i in serving])
            if dec.mesh is not None:
                self._state_sharding = state_sharding(
                    dec.batch_sharding(), jax.eval_shape(start_fn, params, vparams, first)
                )
            state = self._run("start", rows, start_fn, params, vparams, first)
            seen = [int(self.requests.prompt_len[i]) if i >= 0 else 0 for i in serving]
            seen_fwd = [0] * rows
            while any(i >= 0 for i in serving):
                state = yield from self._chunk(
                    chunk_fn, state, serving, seen, seen_fwd, bool(waiting)
                )
                free = [r for r, i in enumerate(serving) if i < 0]
                if waiting and free:
                    t0, c0 = time.perf_counter(), self.compile_seconds
                    state = self._admit(
                        admit_fn, params, vparams, state, free, waiting, serving, seen, seen_fwd
                    )
                    self.seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)

    def _chunk(self, chunk_fn, state, serving: list[int], seen: list[int], seen_fwd: list[int],
               requests_wait: bool, steps: int | None = None):
        """Run one chunk of decode steps (`steps`, default chunk_steps: a runtime argument of
        the one compiled chunk) and yield its events (a row's new tokens, and the output of
        each request that finished); returns the new loop state (`yield from`), with the rows
        cancelled while their events were out finished too. `serving` (the request of each row,
        -1: none), `seen` and `seen_fwd` (tokens and forwards already handed out) are updated in
        place. Iterate it to the end: the state is donated to the chunk."""
        dec, rows = self.decoder, self.settings.num_rows
        params, vparams, hparams = dec.state, dec.verifier_state, dec.head_state
        record = self.options.record_steps
        # decode time excludes what compiling took inside the timed span
        t0, c0 = time.perf_counter(), self.compile_seconds
        finish = np.asarray([i in self._cancelled for i in serving])
        state = self._run(
            "chunk",
            rows,
            chunk_fn,
            params,
            vparams,
            hparams,
            state,
            np.int32(steps or self.chunk_steps),
            np.bool_(requests_wait),
            finish,
            donate=(3,),
        )
        # one transfer of what every chunk needs
        done, length, tokens, forwards, commits, steps = _to_host(
            (state.done, state.length, state.tokens, state.forwards, state.step_commits, state.step)
        )
        self.seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)
        self.chunks += 1
        self.steps = int(steps)
        # what the finished rows' results need, read once (and again if one is cancelled)
        results = None
        if any(done[r] for r, i in enumerate(serving) if i >= 0):
            results = _to_host((state.verifier_forwards, state.accept_hist, state.logprobs))
        for r, i in enumerate(serving):
            if i < 0:
                continue
            new = tokens[r, seen[r]: length[r]].tolist()
            blocks = commits[r, seen_fwd[r]: forwards[r]].tolist() if record else None
            seen[r], seen_fwd[r] = int(length[r]), int(forwards[r])
            if done[r]:
                event = StreamEvent(
                    i,
                    new,
                    blocks,
                    self._output(r, i, tokens[r], length[r], forwards[r], commits, *results),
                )
                serving[r] = -1
                self._finished(i)
                yield event
            elif new:
                yield StreamEvent(i, new, blocks)
        # rows cancelled while their events were out (a stop string): finished here, as
        # far as they got, and their rows free for the admission that follows
        cancelled = [r for r, i in enumerate(serving) if i >= 0 and i in self._cancelled]
        if cancelled:
            results = results or _to_host(
                (state.verifier_forwards, state.accept_hist, state.logprobs)
            )
            for r in cancelled:
                i, serving[r] = serving[r], -1
                event = StreamEvent(
                    i,
                    [],
                    [] if record else None,
                    self._output(r, i, tokens[r], length[r], forwards[r], commits, *results),
                )
                self._finished(i)
                yield event
            state = state.replace(done=jax.device_put(done | np.isin(np.arange(rows), cancelled),
                                                      state.done.sharding))
        return state

    def _finished(self, index: int) -> None:
        """Request `index` has left its row (its output is being handed out)."""

    def _placements(
        self, free: list[int], waiting: list[int], serving: list[int]
    ) -> list[tuple[int, int]]:
        """(row, request) for the next waiting requests, in order, each in a free row whose data
        shard's paged pool has its pages free once the rows `serving` and those placed before
        hold theirs (any free row without a pool); up to the first that fits nowhere."""
        pages = self.settings.num_pages
        if pages == 0:
            return list(zip(free, waiting[::-1]))
        if self._needs is None:  # each request's pages, once
            self._needs = self.decoder.pages_needed(
                self.requests.prompt_len, self.requests.max_new
            ).tolist()
        need = self._needs
        # rows: whole shards (Decoder.rows)
        rows, shards = self.settings.num_rows, self.decoder.data_shards()
        home = lambda r: r // (rows // shards)  # noqa: E731
        used = [0] * shards
        for r, i in enumerate(serving):
            if i >= 0:
                used[home(r)] += need[i]
        placed, open_rows = [], list(free)
        for i in waiting[::-1]:
            row = next((r for r in open_rows if used[home(r)] + need[i] <= pages // shards), None)
            if row is None:
                break
            used[home(row)] += need[i]
            open_rows.remove(row)
            placed.append((row, i))
        return placed

    def _admit(self, admit_fn, params, vparams, state, free, waiting, serving, seen, seen_fwd):
        """Prefill the next waiting requests into the free rows, together: in order, as many as
        rows are free and (with a paged pool) their shards' pages are; none when the next fits
        nowhere. The requests go in blocks, one per row shard (`Decoder.admission_shards`),
        each padded to the fullest block's bucket: every row is prefilled where it lies."""
        rows, dec = self.settings.num_rows, self.decoder
        fine, coarse = dec.admission_shards(rows), dec.data_shards()
        placed = self._placements(_spread(free, rows // fine), waiting, serving)
        if not placed:
            return state
        del waiting[len(waiting) - len(placed):]

        def blocks(shards):
            return [
                [(r, i) for r, i in placed if r // (rows // shards) == j] for j in range(shards)
            ]
        # the smallest size whose blocks hold the rows: blocks of the finest split where the size
        # is a multiple of it, else of the data shards (a cache split over rows on the tensor
        # axis too then takes its rows from the data shard's block, tensor devices alike)
        size, shards = next(
            (b, s)
            for b in _buckets(rows, coarse)
            for s in [fine if b % fine == 0 else coarse]
            if b >= s * max(map(len, blocks(s)))
        )
        blocks = blocks(shards)
        pad = [(rows, len(self.seeds))] * (size // shards)  # past the batch: dropped; no budget
        order = [p for block in blocks for p in (block + pad)[: size // shards]]
        state = self._run(
            "admit",
            size,
            admit_fn,
            params,
            vparams,
            state,
            self._take([i for _, i in order]),
            np.asarray([r for r, _ in order], np.int32),
            donate=(2,),
        )
        for r, i in placed:
            serving[r], seen[r], seen_fwd[r] = i, int(self.requests.prompt_len[i]), 0
        return state

    def _output(self, r: int, i: int, tokens: np.ndarray, length: int, forwards: int, commits,
                verifier_forwards, accept_hist, logprobs) -> RequestOutput:
        """Row r's finished request i, from host copies of the loop state's arrays."""
        p = int(self.requests.prompt_len[i])
        out = tokens[p: length].tolist()
        lp = None
        if logprobs is not None:
            lp = [(float(logprobs.chosen[r, j]), list(zip(logprobs.top_ids[r, j].tolist(),
                                                          logprobs.top_logprobs[r, j].tolist())))
                  for j in range(p, length)]
        return RequestOutput(
            output_ids=out,
            finish_reason="stop" if out and out[-1] in self.requests.stop_ids[i] else "length",
            forwards=int(forwards),
            verifier_forwards=int(verifier_forwards[r]),
            accept_hist=accept_hist[r].tolist(),
            seed=self.seeds[i],
            step_commits=None if commits is None else commits[r, :forwards].tolist(),
            logprobs=lp,
        )


class OpenStream(DecodeStream):
    """A stream that takes requests while it runs (a server's queue): `add` a request, then
    each `step` admits the waiting ones into free rows, runs one chunk and yields its events.
    Every shape is fixed when it is made (rows, prompt width, new-token budget, stop ids per
    request, the queue's `capacity`, what sampling the program does), and `warm_up` compiles
    every program it runs, so nothing compiles while it serves. A request's index is its place
    in the queue's store, used again once its output has been handed out.

    Not thread-safe: one thread adds, cancels and steps (the server's engine thread).
    """

    def __init__(
        self,
        decoder,
        rows: int,
        max_prompt_tokens: int,
        max_new_tokens: int,
        capacity: int,
        sampler: Sampler | None,
        chunk_steps: int = 4,
        max_stop_ids: int = 8,
        log: Callable[[str], None] | None = None,
    ):
        if min(rows, max_prompt_tokens, max_new_tokens, capacity, chunk_steps) < 1:
            raise DecodeError(
                "rows, prompt tokens, new tokens, capacity and chunk steps must all be >= 1, got "
                f"{rows}, {max_prompt_tokens}, {max_new_tokens}, {capacity}, {chunk_steps}"
            )
        if max_prompt_tokens + max_new_tokens > decoder.max_buffer:
            raise DecodeError(
                f"{max_prompt_tokens} prompt tokens + {max_new_tokens} new ones need "
                f"{max_prompt_tokens + max_new_tokens} positions, more than the model's "
                f"{decoder.max_buffer}: lower the prompt or the new-token limit"
            )
        rows = decoder.rows(rows, rows)
        options = adapt_for_batch(decoder.options, rows, table=decoder.adaptive_table)
        width = -(-max_prompt_tokens // 16) * 16
        self.max_prompt_tokens, self.max_new_tokens, self.max_stop_ids = (
            max_prompt_tokens,
            max_new_tokens,
            max_stop_ids,
        )
        self._eos = [int(x) for x in decoder.eos_ids if x >= 0]
        n = capacity + 1  # and the dummy request (no budget) an idle row holds
        store = Requests(
            prompts=np.full((n, width), decoder.pad_id, np.int32),
            prompt_len=np.ones((n,), np.int32),
            max_new=np.zeros((n,), np.int32),
            stop_ids=np.full((n, len(self._eos) + max_stop_ids), -1, np.int32),
            sampling=None if sampler is None else RowSampling.from_params([GREEDY] * n, [0] * n),
        )
        pages = 0
        if options.memory.page_size is not None:
            pages = (
                decoder.pages_per_shard() * decoder.data_shards()
                if options.memory.kv_pages is not None
                else rows * int(decoder.pages_needed(max_prompt_tokens, max_new_tokens))
            )
        settings = dataclasses.replace(
            decoder.program_settings(options, rows, decoder.buffer_len(width, max_new_tokens)),
            sampler=sampler,
            num_pages=pages,
        )
        super().__init__(decoder, store, [0] * capacity, settings, chunk_steps, log)
        if options.memory.page_size is not None:
            self._needs = np.zeros((n,), np.int64)
        self._free_slots = list(range(capacity))[::-1]
        # indices, the oldest last (popped from the end, as in __iter__)
        self._waiting: list[int] = []
        self._serving = [-1] * rows
        self._seen, self._seen_fwd = [0] * rows, [0] * rows
        self._state = None
        self._fns = self._programs()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(i >= 0 for i in self._serving)

    def request_problem(
        self, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[str, str] | None:
        """(the field at fault, why: a phrase following "the request") when the stream cannot
        take this request; None when it can. The fields are SamplingParams' and "prompt"."""
        budget = params.max_new_tokens or self.max_new_tokens
        if len(prompt) > self.max_prompt_tokens:
            return "prompt", (f"has {len(prompt)} prompt tokens, more than this server's limit "
                              f"{self.max_prompt_tokens} (--max-prompt-tokens)")
        if budget > self.max_new_tokens:
            return "max_new_tokens", (
                f"asks for {budget} new tokens, more than this server's limit "
                f"{self.max_new_tokens} (--max-new-tokens)"
            )
        if len(params.stop_token_ids) > self.max_stop_ids:
            return (
                "stop_token_ids",
                f"gives {len(params.stop_token_ids)} stop token ids, more than {self.max_stop_ids}",
            )
        sampler = self.settings.sampler
        if not params.greedy and sampler is None:
            return (
                "temperature",
                "samples (temperature > 0), but this server decodes greedily only (--sampling "
                "greedy)",
            )
        if sampler is not None and not params.greedy:
            unsupported = [
                name
                for name, used, done in (
                    ("top_p", params.top_p < 1, sampler.truncate),
                    ("top_k", params.top_k > 0, sampler.truncate),
                    ("min_p", params.min_p > 0, sampler.min_p),
                )
                if used and not done
            ]
            if unsupported:
                return unsupported[0], (
                    f"uses {unsupported[0]}, which this server's step does not do (--sampling full)"
                )
        problem = self.decoder.prompt_problem(prompt, budget)
        return None if problem is None else ("prompt", f"prompt {problem}")

    def add(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> int:
        """Queue a request (`params` validated; `seed` is used when they give none) and return
        its index, which its events carry. DecodeError when it cannot be served or the queue is
        full."""
        problem = self.request_problem(prompt, params)
        if problem is not None:
            raise DecodeError(f"the request {problem[1]}")
        if not self._free_slots:
            raise DecodeError(f"the queue is full ({len(self.seeds)} requests)")
        i = self._free_slots.pop()
        r, budget = self.requests, params.max_new_tokens or self.max_new_tokens
        r.prompts[i] = self.decoder.pad_id
        r.prompts[i, : len(prompt)] = prompt
        r.prompt_len[i], r.max_new[i] = len(prompt), budget
        stops = self._eos + [t for t in params.stop_token_ids if t not in self._eos]
        r.stop_ids[i] = -1
        r.stop_ids[i, : len(stops)] = stops
        self.seeds[i] = params.seed if params.seed is not None else seed
        if r.sampling is not None:
            one = RowSampling.from_params([params], [self.seeds[i]])
            for field in dataclasses.fields(one):
                getattr(r.sampling, field.name)[i] = getattr(one, field.name)[0]
        if self._needs is not None:
            self._needs[i] = int(self.decoder.pages_needed(len(prompt), budget))
        self._waiting.insert(0, i)
        return i

    def cancel(self, index: int) -> bool:
        """Finish request `index`: True when it was still waiting (dropped, no event follows);
        False when it is decoding (an event carries its output as far as it got, in this step
        if it is running, else in the next)."""
        if index in self._waiting:
            self._waiting.remove(index)
            self._free_slots.append(index)
            return True
        self._cancelled.add(index)
        return False

    def _finished(self, index: int) -> None:
        self._cancelled.discard(index)
        self._free_slots.append(index)

    def _mesh(self):
        return (
            jax.set_mesh(self.decoder.mesh)
            if self.decoder.mesh is not None
            else contextlib.nullcontext()
        )

    def warm_up(self) -> None:
        """Compile every program the stream runs (the rows' first prefill, which it runs, each
        admission size and the decode chunk) and run one empty chunk."""
        dec, rows = self.decoder, self.settings.num_rows
        start_fn, admit_fn, chunk_fn = self._fns
        params, vparams, hparams = dec.state, dec.verifier_state, dec.head_state
        dummy = len(self.seeds)
        with self._mesh():
            first = self._take([dummy] * rows)
            if dec.mesh is not None:
                self._state_sharding = state_sharding(
                    dec.batch_sharding(), jax.eval_shape(start_fn, params, vparams, first)
                )
            self._state = self._run("start", rows, start_fn, params, vparams, first)
            for size in _buckets(rows, dec.data_shards()):
                self._compiled(
                    "admit",
                    size,
                    admit_fn,
                    (
                        params,
                        vparams,
                        self._state,
                        self._take([dummy] * size),
                        np.full((size,), rows, np.int32),
                    ),
                    donate=(2,),
                )
            self._state = self._run(
                "chunk",
                rows,
                chunk_fn,
                params,
                vparams,
                hparams,
                self._state,
                np.int32(1),
                np.bool_(False),
                np.zeros((rows,), bool),
                donate=(3,),
            )
            jax.block_until_ready(self._state)

    def step(self) -> Iterator[StreamEvent]:
        """Admit what waits into the free rows, run one chunk and yield its events; a request
        cancelled while its event is out finishes in this step. Iterate it to the end. The
        chunk after an admission is one step long, so the admitted requests' first tokens go
        out as soon as they are committed, not chunk_steps later (time to first token)."""
        if self._state is None:
            self.warm_up()
        dec = self.decoder
        _, admit_fn, chunk_fn = self._fns
        with self._mesh():
            free = [r for r, i in enumerate(self._serving) if i < 0]
            admitted = False
            if self._waiting and free:
                t0, c0, before = time.perf_counter(), self.compile_seconds, len(self._waiting)
                self._state = self._admit(
                    admit_fn,
                    dec.state,
                    dec.verifier_state,
                    self._state,
                    free,
                    self._waiting,
                    self._serving,
                    self._seen,
                    self._seen_fwd,
                )
                self.seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)
                admitted = len(self._waiting) < before
            if any(i >= 0 for i in self._serving):
                self._state = yield from self._chunk(
                    chunk_fn,
                    self._state,
                    self._serving,
                    self._seen,
                    self._seen_fwd,
                    bool(self._waiting),
                    1 if admitted else None,
                )
