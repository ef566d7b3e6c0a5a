"""Calibrated adaptive lossless: pick (K, groups) per batch size from measurements on this device.

ProVe-lossless wins when the tokens a step commits outweigh what the wider step costs, and both
sides depend on things a fixed table cannot know: the proposer (how often its drafts match its
own greedy) and the hardware (what a width-T forward costs against a one-token forward at this
batch size). Calibration measures both and chooses, per batch size, the layout with the best
expected tokens per unit of AR-step time, or plain AR when none beats 1.0.

Acceptance is measured once, with the widest candidate and every group served: its histogram
of accepted prefix lengths `a` gives every narrower layout too, because MARS drafts are causal
(the first j masks of a group predict the same tokens whatever masks follow), so a layout with
K' tokens accepts min(a, K'-1), and one whose groups serve only some lengths commits the largest
served length <= a, plus the bonus token (see `steps.lossless_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.model import KVCache

# (K, group cap) tried by default: the widths that have paid off somewhere (benchmarks/).
DEFAULT_CANDIDATES: tuple[tuple[int, int], ...] = ((2, 2), (3, 3), (4, 2), (4, 4), (6, 3), (8, 3), (8, 8))


def time_step_widths(model, batch: int, widths: Sequence[int], slots: int = 384, filled: int = 200,
                     repeats: int = 3, steps: int = 10) -> dict[int, float]:
    """Seconds per forward of T new tokens against a `slots`-slot KV cache, for each T.

    Each timing runs `steps` forwards inside one jitted `fori_loop` (the way the decode loop
    runs them: no host round trip per step), whose input depends on the loop carry so XLA
    cannot hoist the forward out of the loop. Widths are interleaved across repeats so a load
    change hits them alike; the median is returned.
    """
    graphdef, state = nnx.split(model)
    cache = KVCache.zeros(model.cfg, batch, slots)
    vocab = model.cfg.vocab_size

    @jax.jit
    def run(state, cache, toks, pos, mask):
        m = nnx.merge(graphdef, state)

        def body(i, carry):
            cache, acc = carry
            logits, cache = m((toks + acc) % vocab, pos, mask, cache, pos)
            return cache, acc + jnp.argmax(logits[:, -1], -1).sum().astype(jnp.int32) % 2
        return jax.lax.fori_loop(0, steps, body, (cache, jnp.int32(0)))[1]

    args = {}
    for t in widths:
        toks = jnp.zeros((batch, t), jnp.int32)
        pos = jnp.broadcast_to(filled + jnp.arange(t), (batch, t))
        mask = jnp.ones((batch, t, slots), bool)
        args[t] = (toks, pos, mask)
        jax.block_until_ready(run(state, cache, *args[t]))  # compile + warm up
    times: dict[int, list[float]] = {t: [] for t in widths}
    for _ in range(repeats):
        for t in widths:
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, cache, *args[t]))
            times[t].append((time.perf_counter() - t0) / steps)
    return {t: float(np.median(v)) for t, v in times.items()}


def expected_tokens_per_forward(accept_probs: np.ndarray, k: int, groups: int | None) -> float:
    """Expected tokens one lossless step of layout (k, groups) commits.

    `accept_probs[a]` = P(the first a drafts match greedy) measured with a wider block; a
    K-token layout sees min(a, K-1), commits the largest served length <= that, plus one.
    """
    layout = LosslessLayout.build(k, groups)
    served = np.asarray(layout.accept_of_group)
    total = 0.0
    for a, p in enumerate(np.asarray(accept_probs, np.float64)):
        a_k = min(a, layout.num_drafts)
        total += p * (served[served <= a_k].max() + 1)
    return float(total)


@dataclasses.dataclass(frozen=True)
class Choice:
    batch_size: int
    block_size: int  # 1 = plain AR
    groups: int
    expected_speedup: float  # expected tokens per forward / step cost relative to AR
    tokens_per_forward: float


def choose_layout(accept_probs: np.ndarray, step_cost: dict[int, float], batch_size: int,
                  candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
                  margin: float = 1.05) -> Choice:
    """The candidate with the best expected speedup over AR; AR unless it wins by `margin`.

    `step_cost[T]` is the time of a width-T forward (any unit; T=1 must be present). The
    margin keeps noise-level wins (a measured 1.02x) from trading AR for a wider program.
    """
    if 1 not in step_cost:
        raise ValueError("step_cost needs the one-token (AR) width T=1")
    best = Choice(batch_size, 1, 1, 1.0, 1.0)
    for k, g in candidates:
        layout = LosslessLayout.build(k, g)
        if layout.width not in step_cost or k - 1 >= len(accept_probs):
            continue
        tpf = expected_tokens_per_forward(accept_probs, k, g)
        speedup = tpf / (step_cost[layout.width] / step_cost[1])
        if speedup > best.expected_speedup and speedup >= margin:
            best = Choice(batch_size, k, len(layout.accept_of_group), speedup, tpf)
    return best


def acceptance_profile(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       block_size: int) -> np.ndarray:
    """P(a) over all steps of one lossless decode with K=block_size and every group served."""
    from prove_jax.decoding.engine import DecodeOptions
    probe = decoder.with_options(DecodeOptions("lossless", block_size))
    # accept_hist has K+1 bins (verify commits up to K); lossless accepts a <= K-1 drafts
    hist = probe.generate(list(prompts), max_new_tokens).accept_hist.sum(axis=0)[:block_size]
    if hist.sum() == 0:
        raise ValueError("calibration decoded no step: give non-empty prompts and max_new_tokens >= 1")
    return hist / hist.sum()


def calibrate(decoder, prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
              max_new_tokens: int = 64, candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
              log=None) -> tuple[tuple[int, int, int], ...]:
    """An adaptive table `((max_batch, K, groups), ...)` for `Decoder(adaptive_table=...)`.

    Decodes `prompts` once (lossless, widest candidate K, all groups) for the acceptance
    profile, then times each candidate width at every batch size. Past the last row (and where
    a row chooses K=1) the decoder runs plain AR.
    """
    k_max = max(k for k, _ in candidates)
    probs = acceptance_profile(decoder, prompts, max_new_tokens, k_max)
    if log:
        log(f"calibrate: acceptance with K={k_max}: " + " ".join(f"{p:.2f}" for p in probs)
            + f" (P(a) for a = 0..{k_max - 1})")
    widths = sorted({1} | {LosslessLayout.build(k, g).width for k, g in candidates})
    model = nnx.merge(decoder.graphdef, decoder.state)
    rows = []
    for b in sorted(set(batch_sizes)):
        with jax.set_mesh(decoder.mesh) if decoder.mesh is not None else contextlib.nullcontext():
            cost = time_step_widths(model, b, widths)
        choice = choose_layout(probs, cost, b, candidates)
        if log:
            what = "AR" if choice.block_size == 1 else f"K={choice.block_size},G={choice.groups}"
            log(f"calibrate: batch {b}: {what} (expected {choice.expected_speedup:.2f}x AR, "
                f"{choice.tokens_per_forward:.2f} tokens per forward)")
        rows.append((b, choice.block_size, choice.groups))
    return tuple(rows)


def calibrate_decoder(decoder, prompts: Sequence[Sequence[int]], batch_size: int,
                      max_new_tokens: int, log=None) -> tuple[tuple[int, int, int], ...]:
    """Calibrate `decoder` (adaptive lossless) for one batch size and install the table.

    Uses up to 8 of the prompts and up to 64 new tokens for the acceptance profile, and the
    candidates whose K fits the decoder's block size (its cap on K).
    """
    from prove_jax.decoding.engine import check_adaptive_table
    k_max = decoder.options.block_size
    table = calibrate(decoder, list(prompts)[:8], [batch_size], min(64, max_new_tokens),
                      [c for c in DEFAULT_CANDIDATES if c[0] <= k_max], log=log)
    decoder.adaptive_table = check_adaptive_table(table)
    return decoder.adaptive_table
