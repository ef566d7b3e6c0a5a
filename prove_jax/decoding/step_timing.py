"""Seconds per decode step of each lossless layout, and per forward of each width, on this device.

What calibration (`calibrate.py`) ranks layouts by, and what the step-cost scripts in benchmarks/
tabulate: the engine's own step (`program.decode_step`) or the bare forward, run many times
inside one jitted loop so no host round trip is timed.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from prove_jax.decoding import program
from prove_jax.decoding.options import DecodeOptions, LosslessRule
from prove_jax.decoding.state import initial_state
from prove_jax.models.attention import KVCache, StepMask, causal_mask
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.timing import fastest_interleaved, timed


def time_step_widths(model, batch: int, widths: Sequence[int], slots: int = 384, filled: int = 200,
                     repeats: int = 5, steps: int = 20, compute: ComputeOptions = DEFAULT_COMPUTE
                     ) -> dict[int, float]:
    """Seconds per forward of T new tokens against a `slots`-slot KV cache, for each T.

    Each timing runs `steps` forwards inside one jitted `fori_loop` (the way the decode loop
    runs them: no host round trip per step), whose input depends on the loop carry so XLA
    cannot hoist the forward out of the loop. Widths are interleaved across repeats so a load
    change hits them alike; the fastest run is returned (a shared machine only adds time).
    """
    graphdef, state = nnx.split(model)
    cache = model.new_cache(batch, slots)
    compute = compute.resolve()  # on the host: the trace reads fields only
    run = jax.jit(functools.partial(_run_forwards, graphdef, compute, steps, model.cfg.vocab_size))
    runs = {}
    for t in widths:
        tokens = jnp.zeros((batch, t), jnp.int32)
        positions = jnp.broadcast_to(filled + jnp.arange(t), (batch, t))
        # `filled` committed slots, then the T new tokens (causal) written after them
        mask = StepMask(jnp.full((batch,), filled, jnp.int32), causal_mask(1, t))
        runs[t] = functools.partial(timed, run, state, cache, tokens, positions, mask)
    return {t: v / steps for t, v in fastest_interleaved(runs, repeats).items()}


def _run_forwards(graphdef, compute: ComputeOptions, steps: int, vocab: int, state, cache, tokens,
                  positions, mask):
    """`steps` forwards of `tokens` (shifted by the carry, so none can be hoisted); a token
    count that depends on every forward."""
    model = nnx.merge(graphdef, state)

    def body(i, carry):
        cache, acc = carry
        logits, cache = model((tokens + acc) % vocab, positions, mask, cache, compute=compute)
        return cache, acc + jnp.argmax(logits[:, -1], -1).sum().astype(jnp.int32) % 2
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.int32(0)))[1]


AR = (1, 1)  # the (K, groups) key of a plain AR step in step-cost tables


def layout_name(key: tuple[int, int]) -> str:
    """"AR" (K=1) or "K=k,G=g": how tables and logs name a (K, groups) step-cost key."""
    return "AR" if key[0] == 1 else f"K={key[0]},G={key[1]}"


def time_decode_steps(
    model,
    batch: int,
    layouts: Sequence[tuple[int, int]],
    slots: int = 384,
    filled: int = 200,
    repeats: int = 5,
    steps: int = 20,
    seconds_per_timing: float = 0.5,
    keep=None,
    compute: ComputeOptions = DEFAULT_COMPUTE,
) -> dict[tuple[int, int], float]:
    """Seconds per decode-loop step of each lossless layout (K, groups), and of AR under key AR.

    Times the engine's own step (`program.decode_step`: forward, LM head on the rows it needs,
    acceptance, commit), not the bare forward: the extra work of a lossless step is a sizeable
    part of its cost on small models. Rows sit at `filled` committed tokens of a `slots`-slot
    buffer; each step is reset there, so every step does the same work. Timings are
    interleaved across layouts; the fastest run is returned.

    Each layout is compiled, run for one step, and then timed over as many steps (up to
    `steps`) as fill about `seconds_per_timing`, since a wide layout at a large batch can take
    seconds a step on a CPU. `keep({layout: seconds per step})` is asked after the first timed
    round which layouts to time `repeats` times (see `fastest_interleaved`).
    """
    runs = decode_step_runs(model, batch, layouts, slots, filled, steps, compute)
    n_steps = {}
    for key, run in runs.items():
        run(1)  # compile and warm up
        n_steps[key] = int(min(steps, max(1, math.ceil(seconds_per_timing / run(1)))))
    sized = {key: functools.partial(run, n_steps[key]) for key, run in runs.items()}
    per_step = None if keep is None else (
        lambda best: keep({key: v / n_steps[key] for key, v in best.items()}))
    best = fastest_interleaved(sized, repeats, keep=per_step, warm_up=False)
    return {key: v / n_steps[key] for key, v in best.items()}


def decode_step_runs(
    model,
    batch: int,
    layouts: Sequence[tuple[int, int]],
    slots: int = 384,
    filled: int = 200,
    steps: int = 20,
    compute: ComputeOptions = DEFAULT_COMPUTE,
) -> dict:
    """{(K, groups) or AR: callable running decode steps (`steps` unless it is given a count)
    and returning their seconds}, for `time_decode_steps` or for timing alongside other runs
    (benchmarks). The step count is an argument of one compiled loop per layout; every step
    runs with `compute`."""
    graphdef, params = nnx.split(model)
    cfg = model.cfg
    mask_id = 0 if cfg.mask_token_id is None else int(cfg.mask_token_id)
    compute = compute.resolve()  # on the host: the trace reads fields only
    keys = [AR] + [tuple(x) for x in layouts if tuple(x) != AR]
    runs = {}
    for key in keys:
        options = (
            DecodeOptions("ar", compute=compute)
            if key == AR
            else DecodeOptions("lossless", key[0], lossless=LosslessRule(max_groups=key[1]),
                               compute=compute)
        ).validate()
        width, n_drafts = program.step_shape(options)
        tokens = jax.random.randint(
            jax.random.PRNGKey(0), (batch, slots), 0, cfg.vocab_size, jnp.int32
        )
        length = jnp.full((batch,), filled, jnp.int32)
        no_stop = jnp.full((batch, 1), -1, jnp.int32)  # no EOS: rows never finish
        cache = KVCache.zeros(cfg, batch, program.cache_slots(slots + width))
        state = initial_state(tokens, length, jnp.full((batch,), slots, jnp.int32), no_stop,
                              cache, None, num_drafts=n_drafts,
                              block_size=options.block_size, pad_id=0)
        fn = jax.jit(functools.partial(_run_steps, graphdef, options, mask_id))

        def run(n=steps, fn=fn, state=state):
            return timed(fn, params, state, jnp.int32(n))
        runs[key] = run
    return runs


def _run_steps(graphdef, options, mask_id: int, params, start, steps):
    """`steps` (traced) decode steps from state `start`, each reset to its row lengths (for
    timing). `options.compute` was resolved on the host (`decode_step_runs`)."""
    model = nnx.merge(graphdef, params)

    def body(_, state):
        state = program.decode_step(options, model, state, mask_id=mask_id,
                                    compute=options.compute)
        return state.replace(length=start.length, cache_len=start.cache_len, done=start.done)
    return jax.lax.fori_loop(0, steps, body, start)
