"""TEMPORARY HOME (moves into decoding/stream.py): the open-ended stream."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from prove_jax.decoding.adaptive import adapt_for_batch
from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.queue import Requests
from prove_jax.decoding.sampling import GREEDY, RowSampling, Sampler, SamplingParams
from prove_jax.decoding.stream import DecodeStream, StreamEvent, _buckets, _to_host, state_sharding


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


class OpenStream(DecodeStream):
    """A stream that takes requests while it runs (a server's queue): `add` a request, then
    each `step` admits waiting requests into free rows and runs one chunk, returning its
    `StreamEvent`s. Every shape is fixed when it is made (rows, prompt width, new-token budget,
    stop ids per request, the queue's `capacity`, sampling), and `warm_up` compiles every
    program it will run, so nothing compiles while it serves.

    Not thread-safe: one thread adds, cancels and steps (the server's engine thread).
    """

    def __init__(self, decoder, rows: int, max_prompt_tokens: int, max_new_tokens: int,
                 capacity: int, sampler: Sampler | None, chunk_steps: int = 4, max_stop_ids: int = 8,
                 log: Callable[[str], None] | None = None):
        if min(rows, max_prompt_tokens, max_new_tokens, capacity, chunk_steps) < 1:
            raise DecodeError(f"rows, prompt tokens, new tokens, capacity and chunk steps must all be "
                              f">= 1, got {rows}, {max_prompt_tokens}, {max_new_tokens}, {capacity}, "
                              f"{chunk_steps}")
        if max_prompt_tokens + max_new_tokens > decoder.max_buffer:
            raise DecodeError(f"{max_prompt_tokens} prompt tokens + {max_new_tokens} new ones need "
                              f"{max_prompt_tokens + max_new_tokens} positions, more than the model's "
                              f"{decoder.max_buffer}: lower the prompt or new-token limit")
        rows = decoder.rows(rows, rows)
        options = adapt_for_batch(decoder.options, rows, table=decoder.adaptive_table)
        width = _round_up(max_prompt_tokens, 16)
        eos = [int(x) for x in decoder.eos_ids if x >= 0]
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.max_stop_ids = max_stop_ids
        self._eos = eos
        n = capacity + 1  # one more: the dummy request (no budget) an idle row holds
        store = Requests(prompts=np.full((n, width), decoder.pad_id, np.int32), prompt_len=np.ones((n,), np.int32),
                         max_new=np.zeros((n,), np.int32),
                         stop_ids=np.full((n, len(eos) + max_stop_ids), -1, np.int32),
                         sampling=None if sampler is None else RowSampling.from_params([GREEDY] * n, [0] * n))
        num_pages = 0
        if options.page_size is not None:
            num_pages = (decoder._pages_per_shard() * decoder._data_size() if options.kv_pages is not None
                         else rows * int(decoder.pages_needed(max_prompt_tokens, max_new_tokens)))
        settings = dataclasses.replace(decoder.program_settings(options, rows, decoder.buffer_len(width, max_new_tokens)),
                                       sampler=sampler, num_pages=num_pages)
        super().__init__(decoder, store, [0] * capacity, settings, chunk_steps, log)
        if options.page_size is not None:
            self._needs = np.zeros((n,), np.int64)
        self._free_slots = list(range(capacity))[::-1]
        self._waiting: list[int] = []  # slots, the oldest last (DecodeStream's order)
        self._serving = [-1] * rows
        self._seen = [0] * rows
        self._seen_fwd = [0] * rows
        self._state = None
        self._fns = self._programs()
        self.steps = 0  # decode steps run (all rows together)

    # ---- the queue ------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(i >= 0 for i in self._serving)

    @property
    def full(self) -> bool:
        return not self._free_slots

    def request_problem(self, prompt: Sequence[int], params: SamplingParams) -> str | None:
        """Why this stream cannot take the request (a phrase following "the request"), or None."""
        budget = params.max_new_tokens or self.max_new_tokens
        if len(prompt) > self.max_prompt_tokens:
            return (f"has {len(prompt)} prompt tokens, more than this server's limit "
                    f"{self.max_prompt_tokens} (--max-prompt-tokens)")
        if budget > self.max_new_tokens:
            return (f"asks for {budget} new tokens, more than this server's limit "
                    f"{self.max_new_tokens} (--max-new-tokens)")
        if len(params.stop_token_ids) > self.max_stop_ids:
            return f"gives {len(params.stop_token_ids)} stop token ids, more than {self.max_stop_ids}"
        if not params.greedy and self.settings.sampler is None:
            return "samples (temperature > 0), but this server decodes greedily only (--sampling greedy)"
        problem = self.decoder.prompt_problem(prompt, budget)
        return None if problem is None else f"prompt {problem}"

    def add(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> int:
        """Queue a request (`params` validated; `seed` used when it gives none); its index, which
        its events carry. Raises DecodeError when it cannot be served or the queue is full."""
        problem = self.request_problem(prompt, params)
        if problem is not None:
            raise DecodeError(f"the request {problem}")
        if not self._free_slots:
            raise DecodeError(f"the queue is full ({len(self.seeds)} requests)")
        i = self._free_slots.pop()
        r = self.requests
        budget = params.max_new_tokens or self.max_new_tokens
        r.prompts[i] = self.decoder.pad_id
        r.prompts[i, : len(prompt)] = prompt
        r.prompt_len[i], r.max_new[i] = len(prompt), budget
        stops = self._eos + [t for t in params.stop_token_ids if t not in self._eos]
        r.stop_ids[i] = -1
        r.stop_ids[i, : len(stops)] = stops
        seed = params.seed if params.seed is not None else seed
        self.seeds[i] = seed
        if r.sampling is not None:
            one = RowSampling.from_params([params], [seed])
            for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
                getattr(r.sampling, name)[i] = getattr(one, name)[0]
        if self._needs is not None:
            self._needs[i] = int(self.decoder.pages_needed(len(prompt), budget))
        self._cancelled.discard(i)
        self._waiting.insert(0, i)
        return i

    def cancel(self, index: int) -> bool:
        """Finish request `index`: True when it was still waiting (dropped, no event follows);
        False when it is decoding (its next event carries its output as far as it got)."""
        if index in self._waiting:
            self._waiting.remove(index)
            self._free_slots.append(index)
            return True
        self._cancelled.add(index)
        return False

    # ---- the loop -------------------------------------------------------------------------

    def _mesh(self):
        return jax.set_mesh(self.decoder.mesh) if self.decoder.mesh is not None else contextlib.nullcontext()

    def warm_up(self) -> None:
        """Compile (and start) every program the stream runs: the first rows' prefill, the
        decode chunk and the admission of each compiled size."""
        dec, rows = self.decoder, self.settings.num_rows
        start_fn, admit_fn, chunk_fn = self._fns
        params, vparams, hparams = dec.state, dec.verifier_state, dec.head_state
        dummy = len(self.seeds)
        with self._mesh():
            first = self._take([dummy] * rows)
            if dec.mesh is not None:
                self._state_sharding = state_sharding(dec._batch_sharding(),
                                                      jax.eval_shape(start_fn, params, vparams, first))
            self._state = self._run("start", rows, start_fn, params, vparams, first)
            for size in _buckets(rows, dec._data_size()):
                self._compiled("admit", size, admit_fn, (params, vparams, self._state, self._take([dummy] * size),
                                                          np.full((size,), rows, np.int32)), donate=(2,))
            self._state = self._run("chunk", rows, chunk_fn, params, vparams, hparams, self._state, np.int32(1),
                                    np.bool_(False), np.zeros((rows,), bool), donate=(3,))
            jax.block_until_ready(self._state)

    def step(self) -> list[StreamEvent]:
        """Admit what waits into free rows, run one chunk, and return what it committed."""
        if self._state is None:
            self.warm_up()
        dec, rows = self.decoder, self.settings.num_rows
        start_fn, admit_fn, chunk_fn = self._fns
        params, vparams, hparams = dec.state, dec.verifier_state, dec.head_state
        serving, seen, seen_fwd = self._serving, self._seen, self._seen_fwd
        events = []
        with self._mesh():
            free = [r for r, i in enumerate(serving) if i < 0]
            if self._waiting and free:
                self._state = self._admit(admit_fn, params, vparams, self._state, free, self._waiting, serving,
                                          seen, seen_fwd)
            if not any(i >= 0 for i in serving):
                return events
            finish = np.asarray([i in self._cancelled for i in serving])
            self._state = self._run("chunk", rows, chunk_fn, params, vparams, hparams, self._state,
                                    np.int32(self.chunk_steps), np.bool_(bool(self._waiting)), finish, donate=(3,))
            state = self._state
            done, length, tokens, forwards, commits, step = _to_host(
                (state.done, state.length, state.tokens, state.forwards, state.step_commits, state.step))
            self.steps = int(step)
            self.chunks += 1
            results = None
            if any(done[r] for r, i in enumerate(serving) if i >= 0):
                results = _to_host((state.verifier_forwards, state.accept_hist, state.logprobs))
            record = self.options.record_steps
            for r, i in enumerate(serving):
                if i < 0:
                    continue
                new = tokens[r, seen[r]: length[r]].tolist()
                blocks = commits[r, seen_fwd[r]: forwards[r]].tolist() if record else None
                seen[r], seen_fwd[r] = int(length[r]), int(forwards[r])
                if done[r]:
                    events.append(StreamEvent(i, new, blocks, self._output(r, i, tokens[r], length[r], forwards[r],
                                                                           commits, *results)))
                    serving[r] = -1
                    self._cancelled.discard(i)
                    self._free_slots.append(i)
                elif new:
                    events.append(StreamEvent(i, new, blocks))
        return events
