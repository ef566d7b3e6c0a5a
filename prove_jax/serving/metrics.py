"""The server's counters in the Prometheus text format (version 0.0.4), kept by hand: a few
counters, gauges and histograms do not need a client library."""

from __future__ import annotations

import bisect
import threading
from typing import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "prove_jax_"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help

    def lines(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}",
                f"# TYPE {self.name} {self.kind}"] + self.samples()

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str):
        super().__init__(name, help)
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def samples(self) -> list[str]:
        return [f"{self.name} {_fmt(self.value)}"]


class Gauge(_Metric):
    """A value read when the metrics are rendered (`kind` "counter" for one that only grows)."""

    def __init__(self, name: str, help: str, read: Callable[[], float], kind: str = "gauge"):
        super().__init__(name, help)
        self.read, self.kind = read, kind

    def samples(self) -> list[str]:
        return [f"{self.name} {_fmt(self.read())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        super().__init__(name, help)
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def samples(self) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.bounds + [float("inf")], self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {total}')
        return out + [f"{self.name}_sum {_fmt(self.sum)}", f"{self.name}_count {self.count}"]


def _fmt(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if x != int(x) else str(int(x))


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """What `GET /metrics` reports. The engine thread and the HTTP handlers both update it,
    under one lock; `queue_depth`, `running` and `compiled` are read from the engine."""

    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int],
                 steps: Callable[[], int], compiled: Callable[[], int]):
        self.lock = threading.Lock()
        self.requests = Counter("requests_total",
                                "requests finished (completed, stopped or cut at their length)")
        self.cancelled = Counter("requests_cancelled_total",
                                 "requests whose client went away before they finished")
        self.rejected = Counter("requests_rejected_total",
                                "requests refused (bad request, too large, queue full)")
        self.prompt_tokens = Counter("prompt_tokens_total",
                                     "prompt tokens of the requests admitted")
        self.generated = Counter("generated_tokens_total",
                                 "tokens generated (committed by the decode loop)")
        self.forwards = Counter("proposer_forwards_total",
                                "proposer forwards while requests decoded (per request)")
        self.per_forward = Histogram("tokens_per_forward",
                                     "tokens one proposer forward committed to a request",
                                     (1, 2, 3, 4, 5, 6, 8, 12, 16))
        self.ttft = Histogram("time_to_first_token_seconds",
                              "from a request's arrival to its first token",
                              LATENCY_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds",
                              "a request's time from its first token to its last, per token after "
                              "the first",
                              LATENCY_BUCKETS)
        self._all = [self.requests, self.cancelled, self.rejected, self.prompt_tokens,
                     self.generated, self.forwards, self.per_forward, self.ttft, self.tpot,
                     Gauge("queue_depth", "requests waiting for a row", queue_depth),
                     Gauge("running_requests", "requests decoding in the batch's rows", running),
                     Gauge("decode_steps_total",
                           "decode steps the loop has run (all rows together)", steps, "counter"),
                     Gauge("compiled_programs",
                           "programs the engine compiled (constant after warm-up)", compiled)]

    def render(self) -> str:
        with self.lock:
            return "\n".join(line for m in self._all for line in m.lines()) + "\n"
