"""The host-driven decode loop: `Decoder.stream` yields each request's tokens as they are
committed and its result as soon as it finishes.

Three compiled programs serve a stream (program.py): `start_batch` fills the rows, `run_chunk`
runs up to `chunk_steps` decode steps inside `jax.lax.while_loop` (the state is donated, so the
caches are updated in place between calls), and `admit_rows` prefills the waiting requests
admitted together into the free rows, in one batched forward (compiled for a power-of-two
number of rows per data shard). Between chunks the host reads the rows' lengths, yields the new tokens, and
refills the rows that finished. A chunk ends early when a row finishes while requests wait, so
a row is never left idle for long.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax import memory
from prove_jax.decoding import program
from prove_jax.decoding.options import DecodeError, DecodeOptions
from prove_jax.decoding.program import ProgramSettings
from prove_jax.decoding.queue import Requests
from prove_jax.decoding.state import LoopState
from prove_jax.models.attention import KVCache, cache_axes
from prove_jax.models.paged import PagedKVCache, pool_axes
from prove_jax.models.sharding import activation_sharding, kv_rules


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
        from jax.experimental import multihost_utils
        return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
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
            pool = lambda x: activation_sharding(mesh, pool_axes(x.ndim == 6), x.shape)  # noqa: E731
            return c.replace(k=jax.tree.map(pool, c.k), v=jax.tree.map(pool, c.v), table=batch, free=batch)
        return None if c is None else jax.tree.map(lambda x: activation_sharding(
            mesh, cache_axes(x.ndim == 5), x.shape, kv_rules(x.shape[1], x.shape[0], mesh)), c)

    return placed.replace(cache=cache(state.cache), verifier_cache=cache(state.verifier_cache))


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
        key = (name, size, self.settings, self.requests.prompts.shape[1], self.requests.stop_ids.shape[1])
        if key not in dec._stream_compiled:
            what = {"start": "the first rows' prefill", "chunk": "the decode step",
                    "admit": f"the prefill of {size} admitted request(s)"}[name]
            self.log(f"compiling {what} ...")
            start = time.perf_counter()
            # with a mesh every program returns the state split over the batch axes, as it takes it
            kw = {} if self._state_sharding is None else {"out_shardings": self._state_sharding}
            compiled = jax.jit(fn, donate_argnums=donate, **kw).lower(*args).compile()
            if name == "chunk":
                memory.check_fits(compiled, memory.local_devices(dec.mesh),
                                  f"decoding {self.settings.num_rows} rows x {self.settings.num_slots} cache "
                                  f"slots (KV caches and loop state, beyond the weights)", error=DecodeError,
                                  advice="lower --batch-size or --max-new-tokens, or shard the batch over "
                                         "more devices")
            dec._stream_compiled[key] = compiled
            self.compile_seconds += time.perf_counter() - start
        return dec._stream_compiled[key]

    def _run(self, name: str, size: int, fn, *args, donate: tuple[int, ...] = ()):
        return self._compiled(name, size, fn, args, donate)(*args)

    def _programs(self):
        dec, s = self.decoder, self.settings
        bound = (dec.graphdef, dec.verifier_graphdef)
        start = functools.partial(program.start_batch, *bound, s)
        admit = functools.partial(program.admit_rows, *bound, s)
        chunk = functools.partial(program.run_chunk, *bound, dec.head_graphdef, s)
        return start, admit, chunk

    def _take(self, indices: list[int]) -> Requests:
        sharding = self.decoder._batch_sharding()
        part = jax.tree.map(lambda x: x[np.asarray(indices)], self.requests)
        return part if sharding is None else jax.device_put(part, sharding)

    # ---- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[StreamEvent]:
        dec, s = self.decoder, self.settings
        rows = s.num_rows
        num = len(self.seeds)
        dummy = num  # the appended request with no budget: a row with it starts done
        start_fn, admit_fn, chunk_fn = self._programs()
        params, vparams, hparams = dec.state, dec.verifier_state, dec.head_state
        waiting = list(range(num))[::-1]  # popped from the end: in order
        serving = [-1] * rows
        for r, i in self._placements(list(range(rows)), waiting, serving):  # all that fit
            serving[r] = i
            waiting.pop()
        record = self.options.record_steps
        with jax.set_mesh(dec.mesh) if dec.mesh is not None else contextlib.nullcontext():
            first = self._take([i if i >= 0 else dummy for i in serving])
            if dec.mesh is not None:
                self._state_sharding = state_sharding(dec._batch_sharding(),
                                                      jax.eval_shape(start_fn, params, vparams, first))
            state = self._run("start", rows, start_fn, params, vparams, first)
            seen = [int(self.requests.prompt_len[i]) if i >= 0 else 0 for i in serving]
            seen_fwd = [0] * rows
            while any(i >= 0 for i in serving):
                # decode time excludes what compiling took inside the timed span
                t0, c0 = time.perf_counter(), self.compile_seconds
                finish = np.asarray([i in self._cancelled for i in serving])
                state = self._run("chunk", rows, chunk_fn, params, vparams, hparams, state,
                                  np.int32(self.chunk_steps), np.bool_(bool(waiting)), finish, donate=(3,))
                # one transfer of what every chunk needs
                done, length, tokens, forwards, commits = _to_host(
                    (state.done, state.length, state.tokens, state.forwards, state.step_commits))
                self.seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)
                self.chunks += 1
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
                        yield StreamEvent(i, new, blocks, self._output(r, i, tokens[r], length[r], forwards[r],
                                                                       commits, *results))
                        serving[r] = -1
                    elif new:
                        yield StreamEvent(i, new, blocks)
                # rows cancelled while their events were out (a stop string): finished here, as
                # far as they got, and their rows free for the admission below
                cancelled = [r for r, i in enumerate(serving) if i >= 0 and i in self._cancelled]
                if cancelled:
                    results = results or _to_host((state.verifier_forwards, state.accept_hist, state.logprobs))
                    for r in cancelled:
                        yield StreamEvent(serving[r], [], [] if record else None,
                                          self._output(r, serving[r], tokens[r], length[r], forwards[r],
                                                       commits, *results))
                        serving[r] = -1
                    state = state.replace(done=jax.device_put(done | np.isin(np.arange(rows), cancelled),
                                                              state.done.sharding))
                free = [r for r, i in enumerate(serving) if i < 0]
                if waiting and free:
                    t0, c0 = time.perf_counter(), self.compile_seconds
                    state = self._admit(admit_fn, params, vparams, state, free, waiting, serving, seen, seen_fwd)
                    self.seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)

    def _placements(self, free: list[int], waiting: list[int], serving: list[int]) -> list[tuple[int, int]]:
        """(row, request) for the next waiting requests, in order, each in a free row whose data
        shard's paged pool has its pages free once the rows `serving` and those placed before
        hold theirs (any free row without a pool); up to the first that fits nowhere."""
        pages = self.settings.num_pages
        if pages == 0:
            return list(zip(free, waiting[::-1]))
        if self._needs is None:  # each request's pages, once
            self._needs = self.decoder.pages_needed(self.requests.prompt_len, self.requests.max_new).tolist()
        need = self._needs
        rows, shards = self.settings.num_rows, self.decoder._data_size()  # rows: whole shards (Decoder.rows)
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
        nowhere."""
        placed = self._placements(free, waiting, serving)
        count = len(placed)
        if count == 0:
            return state
        size = next(b for b in _buckets(self.settings.num_rows, self.decoder._data_size()) if b >= count)
        taken = [i for _, i in placed]
        del waiting[len(waiting) - count:]
        rows = [r for r, _ in placed] + [self.settings.num_rows] * (size - count)  # past the batch: dropped
        state = self._run("admit", size, admit_fn, params, vparams, state,
                          self._take(taken + [len(self.seeds)] * (size - count)),
                          np.asarray(rows, np.int32), donate=(2,))
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
        return RequestOutput(output_ids=out, finish_reason="stop" if out and out[-1] in self.requests.stop_ids[i]
                             else "length", forwards=int(forwards), verifier_forwards=int(verifier_forwards[r]),
                             accept_hist=accept_hist[r].tolist(), seed=self.seeds[i],
                             step_commits=None if commits is None else commits[r, :forwards].tolist(), logprobs=lp)
