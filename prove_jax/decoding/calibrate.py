"""Calibrated adaptive lossless: pick (K, groups) per batch size from measurements on this device.

Whether a wide lossless step pays depends on the proposer (how often its drafts match its own
greedy) and on the hardware (what a wide step costs against an AR step at this batch size),
which no fixed table knows. Calibration measures the acceptance profile once, times each
layout's decode step, ranks the layouts by expected tokens per unit of AR-step time, confirms
the best few with real decodes against AR, and keeps the fastest, or AR unless one wins by 5%
(docs/decoding.md, "Adaptive and calibrated lossless").
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from prove_jax.decoding.adaptive import check_adaptive_table
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import DecodeError, DecodeOptions, LosslessRule
from prove_jax.decoding.step_timing import AR, layout_name, time_decode_steps
from prove_jax.timing import fastest_interleaved

# (K, group cap) tried by default: the widths that have paid off somewhere (benchmarks/).
DEFAULT_CANDIDATES: tuple[tuple[int, int], ...] = (
    (2, 2), (3, 2), (3, 3), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 3), (8, 8))


def expected_tokens_per_forward(accept_probs: np.ndarray, k: int, groups: int | None) -> float:
    """Expected tokens one lossless step of layout (k, groups) commits, in the long run.

    `accept_probs[a]` = P(the first a drafts match greedy) measured with a wider block and every
    group served. A step commits its accepted prefix plus one; how many real drafts the next
    step gets depends on the layout (`mode_steps.lossless_step`): M when a group serves exactly the
    accepted length a, else M - (a - j) for the largest served j <= a. That makes a Markov
    chain over the number of real drafts v, in which a row accepts min(a, v) drafts (filler
    never matches, and the shifted drafts are taken to match as often as fresh ones: optimistic
    for capped layouts); this returns the tokens per step of its stationary distribution.
    With every group served (G = K) v is always M and this is E[min(a, K-1)] + 1.
    """
    layout = LosslessLayout.build(k, groups)
    m = layout.num_drafts
    p = np.asarray(accept_probs, np.float64)
    p_capped = np.zeros(m + 1)
    np.add.at(p_capped, np.minimum(np.arange(len(p)), m), p)  # a K-token layout sees min(a, K-1)
    at_least = np.cumsum(p_capped[::-1])[::-1]  # at_least[i] = P(a >= i)
    served_by_v = np.asarray(layout.served(np.arange(m + 1)))  # [v, group]: the engine's own rule
    move = np.zeros((m + 1, m + 1))  # move[v, v'] = P(next step has v' real drafts | v now)
    tokens = np.zeros(m + 1)  # expected tokens committed by a step with v real drafts
    for v, served in enumerate(served_by_v):
        for a in range(v + 1):
            p_a = at_least[a] - (at_least[a + 1] if a < v else 0.0)
            move[v, m - (a - served[served <= a].max())] += p_a
            tokens[v] += p_a * (a + 1)
    # Power iteration from a row's real start (its first step has no drafts and leaves M) on the
    # lazy chain (stay put with probability 1/2): same stationary distribution, but aperiodic,
    # so it converges even where the chain alternates (one group: a full acceptance leaves no
    # real drafts, and the next step restores them).
    lazy = 0.5 * (move + np.eye(m + 1))
    share = np.eye(m + 1)[m]
    for _ in range(10_000):
        share_next = share @ lazy
        if np.abs(share_next - share).max() < 1e-13:
            break
        share = share_next
    return float(share_next @ tokens)


def expected_batch_tokens_per_forward(row_probs: np.ndarray, k: int, groups: int | None,
                                      batch_size: int, num_requests: int | None = None) -> float:
    """Tokens per step per row when `num_requests` equal-length requests share `batch_size` rows.

    `row_probs` [R, K] holds measured P(a) per request; the requests are drawn from those rows.
    A request of tokens-per-forward t takes 1/t steps per token. The decode ends when the last
    row is done; relative to AR (ceil(Q / B) requests per row, one token per step) that gives
    the rate returned here, the layout's effective tokens per forward.
    - Static batch (`num_requests` <= `batch_size`, the default): the slowest of B rows sets the
      pace; exact expectation over draws with replacement. At batch 1 this is the harmonic mean.
    - Queue (continuous batching, more requests than rows): each request goes to the row that
      frees first; only the tail is uneven. Averaged over 64 seeded draws.
    """
    rows = np.atleast_2d(np.asarray(row_probs, np.float64))
    steps_per_token = np.sort([1.0 / expected_tokens_per_forward(p, k, groups) for p in rows])
    n = len(steps_per_token)
    q = batch_size if num_requests is None else max(num_requests, 1)
    if q <= batch_size:
        # E[max of q draws with replacement] from the order statistics of the rows
        i = np.arange(1, n + 1)
        weight = (i / n) ** q - ((i - 1) / n) ** q
        return float(1.0 / (weight @ steps_per_token))
    rng = np.random.default_rng(0)
    makespans = []
    for _ in range(64):
        free_at = np.zeros(batch_size)
        for u in rng.choice(steps_per_token, size=q):
            free_at[np.argmin(free_at)] += u
        makespans.append(free_at.max())
    return float(-(-q // batch_size) / np.mean(makespans))


@dataclasses.dataclass(frozen=True)
class Choice:
    batch_size: int
    block_size: int  # 1 = plain AR
    groups: int
    expected_speedup: float  # expected tokens per step / step cost relative to AR
    tokens_per_forward: float  # expected per row, slowest-row effect of the batch included
    measured_speedup: float | None = None  # from a trial decode (see `trial_speedups`)

    @property
    def layout(self) -> tuple[int, int]:
        return self.block_size, self.groups

    def describe(self) -> str:
        return layout_name(self.layout)


def rank_layouts(row_probs: np.ndarray, step_cost: dict[tuple[int, int], float], batch_size: int,
                 candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
                 num_requests: int | None = None) -> list[Choice]:
    """Every candidate with a measured cost, by expected speedup over AR (best first).

    `row_probs` [R, K] (or [K]): P(accepted prefix a) per request, measured with K >= every
    candidate's. `step_cost[(K, G)]` is the time of one decode step of that layout (any unit)
    and `step_cost[AR]` that of an AR step (see `time_decode_steps`). `num_requests` is how
    many requests the rows serve at once (default: a static batch).
    """
    ranked = []
    for (k, g), (speedup, tpf) in _expected(
        row_probs, step_cost, batch_size, candidates, num_requests
    ).items():
        ranked.append(Choice(batch_size, k, LosslessLayout.build(k, g).num_groups, speedup, tpf))
    return sorted(ranked, key=lambda c: -c.expected_speedup)


def expected_speedups(
    row_probs: np.ndarray,
    step_cost: dict[tuple[int, int], float],
    batch_size: int,
    candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
    num_requests: int | None = None,
) -> dict[tuple[int, int], float]:
    """{candidate (K, G): expected speedup over AR}, as `rank_layouts` ranks them."""
    return {
        key: v[0]
        for key, v in _expected(row_probs, step_cost, batch_size, candidates, num_requests).items()
    }


def _expected(row_probs, step_cost, batch_size, candidates, num_requests):
    """{(K, G): (expected speedup, tokens per forward)} of the candidates with a cost."""
    if AR not in step_cost:
        raise ValueError(f"step_cost needs the AR step under key {AR}")
    k_measured = np.atleast_2d(row_probs).shape[1]
    out = {}
    for k, g in candidates:
        if (k, g) not in step_cost or k > k_measured:
            continue
        tpf = expected_batch_tokens_per_forward(row_probs, k, g, batch_size, num_requests)
        out[(k, g)] = (tpf / (step_cost[(k, g)] / step_cost[AR]), tpf)
    return out


# A layout whose expected speedup over AR, from its first step timing, is below this is not
# timed again: the model is optimistic for wide layouts, so one that loses by a quarter on
# paper loses for real, and re-timing it is most of a calibration's time at large batch.
PRUNE_BELOW = 0.75


class PromisingLayouts:
    """The `keep` rule of `time_decode_steps` in `calibrate`: given {layout: seconds per step}
    from one timed round, the layouts worth timing again (AR always); `dropped` lists the rest."""

    def __init__(
        self,
        row_probs: np.ndarray,
        batch_size: int,
        candidates: Sequence[tuple[int, int]],
        num_requests: int | None = None,
        floor: float = PRUNE_BELOW,
    ):
        self.row_probs, self.batch_size, self.candidates = row_probs, batch_size, candidates
        self.num_requests, self.floor = num_requests, floor
        self.dropped: list[tuple[int, int]] = []

    def __call__(self, cost: dict) -> set:
        speedups = expected_speedups(
            self.row_probs, cost, self.batch_size, self.candidates, self.num_requests
        )
        self.dropped = [key for key, s in speedups.items() if s < self.floor]
        return set(cost) - set(self.dropped)


def choose_layout(row_probs: np.ndarray, step_cost: dict[tuple[int, int], float], batch_size: int,
                  candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
                  margin: float = 1.05, num_requests: int | None = None) -> Choice:
    """The candidate with the best expected speedup over AR; AR unless it wins by `margin`
    (which keeps noise-level wins, a predicted 1.02x, from trading AR for a wider program)."""
    ranked = rank_layouts(row_probs, step_cost, batch_size, candidates, num_requests)
    if ranked and ranked[0].expected_speedup >= margin:
        return ranked[0]
    return Choice(batch_size, 1, 1, 1.0, 1.0)


def trial_speedups(
    decoder,
    prompts: Sequence[Sequence[int]],
    layouts: Sequence[tuple[int, int]],
    batch_size: int,
    max_new_tokens: int,
    repeats: int = 2,
) -> dict[tuple[int, int], float]:
    """Measured throughput of each lossless layout relative to AR: real decodes of `prompts`.

    The engine's own program at this batch size (prefill, queue, loop and all), each compiled
    and warmed up first, then timed `repeats` times interleaved; the fastest run counts, since
    a shared machine only ever adds time. Lossless output equals AR, so the time ratio is the
    throughput ratio.
    """
    compute = decoder.options.compute
    settings = {AR: DecodeOptions("ar", compute=compute)} | {
        (k, g): DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=g), compute=compute)
        for k, g in layouts}
    decoders = {key: decoder.with_options(opts) for key, opts in settings.items()}
    runs = {
        key: (lambda d=d: d.generate(list(prompts), max_new_tokens, batch_size=batch_size).seconds)
        for key, d in decoders.items()
    }
    best = fastest_interleaved(runs, repeats)
    return {key: best[AR] / best[key] for key in layouts}


def acceptance_profile(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       block_size: int) -> np.ndarray:
    """P(a) per prompt [R, K] from one lossless decode with K=block_size and every group served."""
    probe = decoder.with_options(
        DecodeOptions("lossless", block_size, compute=decoder.options.compute)
    )
    # accept_hist has K+1 bins (verify commits up to K); lossless accepts a <= K-1 drafts
    hist = (
        probe.generate(list(prompts), max_new_tokens).accept_hist[:, :block_size].astype(np.float64)
    )
    hist = hist[hist.sum(axis=1) > 0]
    if not len(hist):
        raise ValueError(
            "calibration decoded no step: give non-empty prompts and max_new_tokens >= 1"
        )
    return hist / hist.sum(axis=1, keepdims=True)


def calibrate(decoder, prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
              max_new_tokens: int = 64, candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
              log=None, num_requests: int | None = None, trials: int = 4,
              margin: float = 1.05) -> tuple[tuple[int, int, int], ...]:
    """An adaptive table `((max_batch, K, groups), ...)` for `Decoder(adaptive_table=...)`.

    Decodes `prompts` once (lossless, widest candidate K, all groups) for the per-prompt
    acceptance profile and times the decode step of AR and of each candidate at every batch
    size: that ranks the candidates by expected speedup. The model misses what a real decode
    adds (prefill, loop overhead, a noisy machine), so the `trials` best-ranked layouts, plus
    the narrowest, are then decoded for real against AR (`trial_speedups`) and the fastest is
    kept; AR unless it wins by `margin`. `trials=0` trusts the model alone. `num_requests`:
    requests per `generate` call (None: a static batch per call). Past the last row (and where
    a row chooses K=1) the decoder runs plain AR.
    """
    k_max = max(k for k, _ in candidates)
    rows = acceptance_profile(decoder, prompts, max_new_tokens, k_max)
    if log:
        log(f"calibrate: acceptance with K={k_max} over {len(rows)} prompts: "
            + " ".join(f"{p:.2f}" for p in rows.mean(axis=0)) + f" (P(a) for a = 0..{k_max - 1})")
    model = nnx.merge(decoder.graphdef, decoder.state)
    table = []
    for b in sorted(set(batch_sizes)):
        keep = PromisingLayouts(rows, b, candidates, num_requests)
        with jax.set_mesh(decoder.mesh) if decoder.mesh is not None else contextlib.nullcontext():
            cost = time_decode_steps(
                model, b, candidates, keep=keep, compute=decoder.options.compute
            )
        if log:
            log(
                f"calibrate: batch {b}: AR step {cost[AR] * 1e3:.1f} ms; layout steps in AR steps: "
                + ", ".join(
                    f"{layout_name((k, g))} {cost[(k, g)] / cost[AR]:.2f}"
                    for k, g in candidates
                    if (k, g) in cost
                )
            )
            if keep.dropped:
                log(f"calibrate: batch {b}: timed once, expected below {PRUNE_BELOW:.2f}x AR: "
                    + ", ".join(map(layout_name, keep.dropped)))
        ranked = rank_layouts(rows, cost, b, candidates, num_requests)
        shortlist = [c for c in ranked[:trials] if c.expected_speedup >= 1.0]
        narrowest = min(ranked, key=lambda c: (c.block_size, c.groups), default=None)
        if trials and narrowest is not None and narrowest not in shortlist:
            shortlist.append(narrowest)
        if shortlist and trials:
            measured = trial_speedups(
                decoder, prompts, [c.layout for c in shortlist], b, max_new_tokens
            )
            shortlist = [
                dataclasses.replace(c, measured_speedup=measured[c.layout]) for c in shortlist
            ]
            if log:
                log(
                    f"calibrate: batch {b} trials (measured / expected speedup): "
                    + ", ".join(
                        f"{c.describe()} {c.measured_speedup:.2f}x / {c.expected_speedup:.2f}x"
                        for c in shortlist
                    )
                )
            best = max(shortlist, key=lambda c: c.measured_speedup)
            choice = best if best.measured_speedup >= margin else Choice(b, 1, 1, 1.0, 1.0, 1.0)
        else:
            choice = choose_layout(rows, cost, b, candidates, margin, num_requests)
        if log:
            seen = (
                ""
                if choice.measured_speedup is None
                else f"measured {choice.measured_speedup:.2f}x, "
            )
            log(
                f"calibrate: batch {b}: {choice.describe()} ({seen}expected "
                f"{choice.expected_speedup:.2f}x AR, "
                f"{choice.tokens_per_forward:.2f} tokens per step per row)"
            )
        table.append((b, choice.block_size, choice.groups))
    return tuple(table)


def calibrate_decoder(decoder, prompts: Sequence[Sequence[int]], batch_size: int,
                      max_new_tokens: int, log=None, num_requests: int | None = None
                      ) -> tuple[tuple[int, int, int], ...]:
    """Calibrate `decoder` (adaptive lossless) for one batch size and install the table.

    Uses up to max(8, rows) of the prompts and up to 64 new tokens for the acceptance profile
    and the trial decodes, and the candidates within the decoder's block size and group cap.
    `num_requests`: how many requests each `generate` call will queue (default: all of
    `prompts`).
    """
    if batch_size < 1:
        raise DecodeError(f"batch size must be >= 1, got {batch_size}")
    num_requests = len(prompts) if num_requests is None else num_requests
    # the rows `generate` will decode with (capped at the requests, whole data-axis shards):
    # the table is looked up, and must be measured, at that size
    rows = decoder.rows(batch_size, num_requests)
    k_max, g_max = decoder.options.block_size, decoder.options.lossless.max_groups
    candidates = [
        (k, g) for k, g in DEFAULT_CANDIDATES if k <= k_max and (g_max is None or g <= g_max)
    ]
    if not candidates:
        raise DecodeError(
            f"no lossless layout to calibrate with K <= {k_max} and groups <= {g_max}; "
            f"the narrowest is K=2 with 2 groups"
        )
    table = calibrate(decoder, list(prompts)[:max(8, rows)], [rows], min(64, max_new_tokens),
                      candidates, log=log, num_requests=num_requests)
    decoder.adaptive_table = check_adaptive_table(table)
    return decoder.adaptive_table
