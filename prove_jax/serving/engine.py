"""The engine thread: one open-ended decode stream fed by every connection.

HTTP handlers (the asyncio thread) `submit` requests and `cancel` them; the engine thread
loads the model, compiles every program the stream runs, then loops: take what was submitted,
admit it into free rows between chunks, run a chunk, and hand each request's new text to its
handler's queue. Stop strings are found here, on the committed blocks, and end their request's
row at once (requests.StopStrings, as `generate` finds them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import traceback
from typing import Callable, Sequence

from prove_jax.errors import ProveJaxError
from prove_jax.decoding.engine import request_seed
from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.request_run import feed_blocks, stream_result
from prove_jax.decoding.sampling import Sampler, SamplingParams
from prove_jax.decoding.stopping import StopStrings
from prove_jax.decoding.stream import OpenStream
from prove_jax.serving.metrics import ServerMetrics

# --sampling: the static side of the one program every request shares (sampling.Sampler)
SAMPLERS = {"full": Sampler(truncate=True, min_p=True), "temperature": Sampler(), "greedy": None}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The shapes the server compiles for; a request beyond them is refused with the reason."""

    rows: int = 8
    """Requests decoded together (the batch); more wait in the queue for a free row."""
    max_prompt_tokens: int = 512
    """Longest prompt a request may send (the program's prompt width)."""
    max_new_tokens: int = 256
    """Most new tokens a request may ask for, and what one that gives no max_tokens gets."""
    max_queue: int = 256
    """Requests waiting or decoding at once; beyond them the server answers 429."""
    chunk_steps: int = 4
    """Decode steps per device call: requests join the batch and text goes out between calls."""
    sampling: str = "full"
    """Which sampling the program does: "full" (temperature, top-k/top-p, min-p), "temperature"
    (no vocabulary sort), "greedy" (temperature 0 only)."""
    shutdown_seconds: float = 10.0
    """On SIGTERM, in-flight requests get this long to finish before they are cancelled."""


@dataclasses.dataclass
class Update:
    """What the engine hands a request's handler: its text so far (`text`; with `final`, the
    whole completion) and, with `final`, the result. `error` set: the request failed."""
    text: str
    final: bool = False
    output_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: list | None = None
    error: str | None = None


class Handle:
    """A submitted request as its HTTP handler sees it: updates arrive on `updates`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: Sequence[int],
                 params: SamplingParams):
        self.loop = loop
        self.prompt, self.params = list(prompt), params
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.finished = False

    def post(self, update: Update) -> None:
        if update.final or update.error is not None:
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop has closed (shutting down): nobody is listening
            pass


@dataclasses.dataclass
class _Live:
    handle: Handle
    stops: StopStrings
    first_token: float | None = None
    generated: int = 0
    aborted: bool = False  # cancelled by the shutdown's bound: its finish reason is "abort"


class Engine:
    """Owns the decoder and its open stream on a thread of its own (see the module docstring).

    `load()` returns (decoder, tokenizer); it runs on the engine thread, so the server answers
    /health (503) while the model loads and compiles."""

    def __init__(self, load: Callable[[], tuple], options: ServeOptions, seed: int = 0,
                 log: Callable[[str], None] | None = None):
        self.options = options
        self.seed = seed
        self.log = log or (lambda msg: None)
        self._load = load
        self.decoder = self.tokenizer = self.stream = None
        self.ready = threading.Event()
        self.error: str | None = None  # why loading failed
        self.on_error: Callable[[str], None] | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, _Live] = {}
        self._by_handle: dict[int, int] = {}  # id(handle) -> stream index
        self._submitted = 0
        self._pending = 0  # submitted, not yet taken by the engine thread
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._main, name="prove-jax-engine", daemon=True)
        self.metrics = ServerMetrics(
            queue_depth=lambda: (self.stream.waiting if self.stream else 0) + self._pending,
            running=lambda: self.stream.running if self.stream else 0,
            steps=lambda: self.stream.steps if self.stream else 0,
            compiled=lambda: self.decoder.program_count if self.decoder else 0)

    # ---- the HTTP side (any thread) -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """The engine thread has not ended (it may be loading or compiling)."""
        return self._thread.is_alive()

    def request_problem(self, prompt: Sequence[int],
                        params: SamplingParams) -> tuple[str, str] | None:
        """(field, why) the request cannot be served (OpenStream.request_problem), or None;
        checked on the caller's thread, before anything is queued."""
        return self.stream.request_problem(prompt, params)

    def submit(self, handle: Handle) -> None:
        """Queue a checked request (`request_problem` is None); its updates go to its handle.
        Raises DecodeError when the queue is full or the server is stopping."""
        if self._stopping.is_set():
            raise DecodeError("the server is shutting down")
        if self._pending + len(self._live) >= self.options.max_queue:
            raise DecodeError(f"the server is busy: {self.options.max_queue} requests are queued "
                              f"or decoding (--max-queue); retry later")
        with self._lock:
            self._pending += 1
        self._inbox.put(("submit", handle))

    def cancel(self, handle: Handle) -> None:
        """The client went away: free the request's row (or its place in the queue)."""
        if not handle.finished:
            self._inbox.put(("cancel", handle))

    def begin_stop(self) -> None:
        """Stop taking requests; those in flight get options.shutdown_seconds to finish, then
        end with finish_reason "abort" (their text so far). Called on SIGTERM."""
        if not self._stopping.is_set():
            self._deadline = time.perf_counter() + self.options.shutdown_seconds
            self._stopping.set()
            self._inbox.put(("wake", None))

    def stop(self, timeout: float | None = None) -> None:
        """`begin_stop`, then wait until the engine thread has ended (at most `timeout`)."""
        self.begin_stop()
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.decoder, self.tokenizer = self._load()
            o = self.options
            self.stream = OpenStream(self.decoder, o.rows, o.max_prompt_tokens, o.max_new_tokens,
                                     capacity=o.max_queue, sampler=SAMPLERS[o.sampling],
                                     chunk_steps=o.chunk_steps, log=self.log)
            start = time.perf_counter()
            self.stream.warm_up()
            self.log(f"compiled {self.decoder.program_count} programs in "
                     f"{time.perf_counter() - start:.1f}s; serving {self.stream.settings.num_rows} "
                     "rows")
        except Exception as e:  # noqa: BLE001 - reported as the server's error, then it exits
            if isinstance(e, (ProveJaxError, ValueError, OSError)):  # the command line reports it
                self.error = str(e)
            else:
                self.error = traceback.format_exc()
                self.log(self.error)
            if self.on_error is not None:
                self.on_error(self.error)
            return
        self.ready.set()
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - a bug: fail every request in flight, say why
            self.error = traceback.format_exc()
            self.log(self.error)
            for live in self._live.values():
                live.handle.post(Update("", error="the engine failed; see the server's log"))
            if self.on_error is not None:
                self.on_error(self.error)

    def _serve(self) -> None:
        stream = self.stream
        while True:
            idle = not self._live
            if idle and self._stopping.is_set():
                break
            items = []
            if idle:  # nothing decodes: wait for a request
                try:
                    items.append(self._inbox.get(timeout=0.5))
                except queue.Empty:
                    pass
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, handle in items:
                if kind == "submit":
                    with self._lock:
                        self._pending -= 1
                    self._admit(handle)
                elif kind == "cancel":
                    self._cancel(handle)
            if (self._stopping.is_set() and self._deadline is not None
                    and time.perf_counter() > self._deadline):
                self._deadline = None
                for index, live in list(self._live.items()):
                    live.aborted = True
                    if self.stream.cancel(index):  # still waiting: it ends now, with no text
                        self._finish(index)
                        if not isinstance(live.handle, _Gone):
                            live.handle.post(Update("", final=True, output_ids=[],
                                                    finish_reason="abort"))
            if not self._live:
                continue
            for event in stream.step():
                self._deliver(event)

    def _admit(self, handle: Handle) -> None:
        if self._stopping.is_set():
            handle.post(Update("", error="the server is shutting down"))
            return
        try:
            index = self.stream.add(handle.prompt, handle.params, self._next_seed())
        except DecodeError as e:  # checked before submit; the queue may have filled since
            handle.post(Update("", error=str(e)))
            return
        self._live[index] = _Live(handle, StopStrings(self.tokenizer, handle.params.stop))
        self._by_handle[id(handle)] = index
        with self.metrics.lock:
            self.metrics.prompt_tokens.inc(len(handle.prompt))

    def _next_seed(self) -> int:
        self._submitted += 1
        return request_seed(self.seed, self._submitted - 1)

    def _cancel(self, handle: Handle) -> None:
        index = self._by_handle.get(id(handle))
        if index is None or index not in self._live or self._live[index].handle is not handle:
            return
        with self.metrics.lock:
            self.metrics.cancelled.inc()
        if self.stream.cancel(index):  # it was still waiting: gone now
            self._finish(index)
            handle.post(Update("", final=True, output_ids=[], finish_reason="cancelled"))
        else:
            handle.finished = True  # its output (cut short) arrives with the next chunk, unsent
            self._live[index].handle = _Gone(handle)

    def _finish(self, index: int) -> _Live:
        live = self._live.pop(index)
        handle = live.handle.original if isinstance(live.handle, _Gone) else live.handle
        self._by_handle.pop(id(handle), None)
        return live

    def _deliver(self, event) -> None:
        live = self._live[event.index]
        now = time.perf_counter()
        if event.new_ids:
            if live.first_token is None:
                live.first_token = now
                if not isinstance(live.handle, _Gone):
                    with self.metrics.lock:
                        self.metrics.ttft.observe(now - live.handle.arrived)
            live.generated += len(event.new_ids)
            with self.metrics.lock:
                self.metrics.generated.inc(len(event.new_ids))
                for n in event.blocks or ():
                    self.metrics.per_forward.observe(n)
            if not live.stops.stopped and feed_blocks(live.stops, event.new_ids,
                                                      event.blocks or [len(event.new_ids)]):
                self.stream.cancel(event.index)  # the row stops before the next chunk's first step
        if event.output is None:
            if not isinstance(live.handle, _Gone) and event.new_ids:
                live.handle.post(Update(live.stops.text))
            return
        self._finish(event.index)
        out = event.output
        result = stream_result(out, live.stops)
        text = result.text
        if text is None:
            text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if isinstance(live.handle, _Gone):
            return
        with self.metrics.lock:
            self.metrics.requests.inc()
            self.metrics.forwards.inc(out.forwards)
            n = len(result.output_ids)
            if n > 1 and live.first_token is not None:
                self.metrics.tpot.observe((now - live.first_token) / (n - 1))
        reason = "abort" if live.aborted and not live.stops.stopped else result.finish_reason
        live.handle.post(Update(text, final=True, output_ids=result.output_ids,
                                finish_reason=reason, logprobs=result.logprobs))


class _Gone:
    """The handle of a request whose client went away: its row finishes unseen."""

    def __init__(self, original: Handle):
        self.original = original
