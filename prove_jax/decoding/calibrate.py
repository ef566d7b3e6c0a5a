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
served length <= a, plus the bonus token (see `steps.lossless_step`). Acceptance is kept per
prompt: a static batch steps until its slowest row is done, so at larger batches the prompts
that accept least decide what a layout gains.

Costs are those of the engine's whole decode step (forward, LM head, acceptance, commit), timed
per layout and batch size on this device.
"""

from __future__ import annotations

import contextlib
import functools
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
DEFAULT_CANDIDATES: tuple[tuple[int, int], ...] = (
    (2, 2), (3, 2), (3, 3), (4, 2), (4, 4), (6, 2), (6, 3), (8, 3), (8, 8))


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


AR = (1, 1)  # the (K, groups) key of a plain AR step in step-cost tables


def time_decode_steps(model, batch: int, layouts: Sequence[tuple[int, int]], slots: int = 384,
                      filled: int = 200, repeats: int = 3, steps: int = 10) -> dict[tuple[int, int], float]:
    """Seconds per decode-loop step of each lossless layout (K, groups), and of AR under key AR.

    Times the engine's own step (`engine.decode_step`: forward, LM head on the rows it needs,
    acceptance, commit), not the bare forward: the extra work of a lossless step is a sizeable
    part of its cost on small models. Rows sit at `filled` committed tokens of a `slots`-slot
    buffer; each step is reset there, so every step does the same work. Timings are
    interleaved across layouts; the median is returned.
    """
    from prove_jax.decoding.engine import DecodeOptions, step_shape
    from prove_jax.decoding.state import initial_state

    graphdef, params = nnx.split(model)
    cfg = model.cfg
    mask_id = 0 if cfg.mask_token_id is None else int(cfg.mask_token_id)
    keys = [AR] + [tuple(x) for x in layouts if tuple(x) != AR]
    runs, inputs = {}, {}
    for key in keys:
        options = (DecodeOptions("ar") if key == AR
                   else DecodeOptions("lossless", key[0], max_groups=key[1])).validate()
        width, n_drafts = step_shape(options)
        tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, slots), 0, cfg.vocab_size, jnp.int32)
        length = jnp.full((batch,), filled, jnp.int32)
        state = initial_state(tokens, length, jnp.full((batch,), slots, jnp.int32),
                              KVCache.zeros(cfg, batch, slots + width), None, num_drafts=n_drafts,
                              block_size=options.block_size, pad_id=0)

        runs[key] = jax.jit(functools.partial(_run_steps, graphdef, options, mask_id, steps))
        inputs[key] = state
        jax.block_until_ready(runs[key](params, state))  # compile + warm up
    times: dict[tuple[int, int], list[float]] = {key: [] for key in keys}
    for _ in range(repeats):
        for key in keys:
            t0 = time.perf_counter()
            jax.block_until_ready(runs[key](params, inputs[key]))
            times[key].append((time.perf_counter() - t0) / steps)
    return {key: float(np.median(v)) for key, v in times.items()}


def _run_steps(graphdef, options, mask_id: int, steps: int, params, state):
    """`steps` decode steps from `state`, each reset to the same row lengths (for timing)."""
    from prove_jax.decoding.engine import decode_step
    model = nnx.merge(graphdef, params)
    eos = jnp.asarray([-1], jnp.int32)  # no EOS: rows never finish

    def body(_, st):
        st = decode_step(options, model, st, eos, mask_id=mask_id)
        return st.replace(length=state.length, cache_len=state.cache_len, done=state.done)
    return jax.lax.fori_loop(0, steps, body, state)


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


def choose_layout(row_probs: np.ndarray, step_cost: dict[tuple[int, int], float], batch_size: int,
                  candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
                  margin: float = 1.05, num_requests: int | None = None) -> Choice:
    """The candidate with the best expected speedup over AR; AR unless it wins by `margin`.

    `row_probs` [R, K] (or [K]): P(accepted prefix a) per request, measured with K >= every
    candidate's. `step_cost[(K, G)]` is the time of one decode step of that layout (any unit)
    and `step_cost[AR]` that of an AR step (see `time_decode_steps`). `num_requests` is how
    many requests the rows serve at once (default: a static batch). The margin keeps
    noise-level wins (a measured 1.02x) from trading AR for a wider program.
    """
    if AR not in step_cost:
        raise ValueError(f"step_cost needs the AR step under key {AR}")
    k_measured = np.atleast_2d(row_probs).shape[1]
    best = Choice(batch_size, 1, 1, 1.0, 1.0)
    for k, g in candidates:
        if (k, g) not in step_cost or k > k_measured:
            continue
        tpf = expected_batch_tokens_per_forward(row_probs, k, g, batch_size, num_requests)
        speedup = tpf / (step_cost[(k, g)] / step_cost[AR])
        if speedup > best.expected_speedup and speedup >= margin:
            best = Choice(batch_size, k, len(LosslessLayout.build(k, g).accept_of_group), speedup, tpf)
    return best


def acceptance_profile(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       block_size: int) -> np.ndarray:
    """P(a) per prompt [R, K] from one lossless decode with K=block_size and every group served."""
    from prove_jax.decoding.engine import DecodeOptions
    probe = decoder.with_options(DecodeOptions("lossless", block_size))
    # accept_hist has K+1 bins (verify commits up to K); lossless accepts a <= K-1 drafts
    hist = probe.generate(list(prompts), max_new_tokens).accept_hist[:, :block_size].astype(np.float64)
    hist = hist[hist.sum(axis=1) > 0]
    if not len(hist):
        raise ValueError("calibration decoded no step: give non-empty prompts and max_new_tokens >= 1")
    return hist / hist.sum(axis=1, keepdims=True)


def calibrate(decoder, prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
              max_new_tokens: int = 64, candidates: Sequence[tuple[int, int]] = DEFAULT_CANDIDATES,
              log=None, num_requests: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """An adaptive table `((max_batch, K, groups), ...)` for `Decoder(adaptive_table=...)`.

    Decodes `prompts` once (lossless, widest candidate K, all groups) for the per-prompt
    acceptance profile, then times the decode step of AR and of each candidate at every batch
    size. `num_requests`: requests per `generate` call (None: a static batch per call). Past
    the last row (and where a row chooses K=1) the decoder runs plain AR.
    """
    k_max = max(k for k, _ in candidates)
    rows = acceptance_profile(decoder, prompts, max_new_tokens, k_max)
    if log:
        log(f"calibrate: acceptance with K={k_max} over {len(rows)} prompts: "
            + " ".join(f"{p:.2f}" for p in rows.mean(axis=0)) + f" (P(a) for a = 0..{k_max - 1})")
    model = nnx.merge(decoder.graphdef, decoder.state)
    table = []
    for b in sorted(set(batch_sizes)):
        with jax.set_mesh(decoder.mesh) if decoder.mesh is not None else contextlib.nullcontext():
            cost = time_decode_steps(model, b, candidates)
        choice = choose_layout(rows, cost, b, candidates, num_requests=num_requests)
        if log:
            what = "AR" if choice.block_size == 1 else f"K={choice.block_size},G={choice.groups}"
            log(f"calibrate: batch {b}: {what} (expected {choice.expected_speedup:.2f}x AR, "
                f"{choice.tokens_per_forward:.2f} tokens per step per row)")
        table.append((b, choice.block_size, choice.groups))
    return tuple(table)


def calibrate_decoder(decoder, prompts: Sequence[Sequence[int]], batch_size: int,
                      max_new_tokens: int, log=None, num_requests: int | None = None
                      ) -> tuple[tuple[int, int, int], ...]:
    """Calibrate `decoder` (adaptive lossless) for one batch size and install the table.

    Uses up to 8 of the prompts and up to 64 new tokens for the acceptance profile, and the
    candidates whose K fits the decoder's block size (its cap on K). `num_requests`: how many
    requests each `generate` call will queue (default: all of `prompts`).
    """
    from prove_jax.decoding.engine import check_adaptive_table
    k_max = decoder.options.block_size
    table = calibrate(decoder, list(prompts)[:8], [batch_size], min(64, max_new_tokens),
                      [c for c in DEFAULT_CANDIDATES if c[0] <= k_max], log=log,
                      num_requests=len(prompts) if num_requests is None else num_requests)
    decoder.adaptive_table = check_adaptive_table(table)
    return decoder.adaptive_table
