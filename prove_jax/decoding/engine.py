"""The decoding engine: one compiled `jax.lax.while_loop` per (rows, queue, prompt width, buffer, mode).

Prefill and the whole generation run inside a single jitted function; the host only sees the
final buffers. A call may queue more prompts than the batch has rows: finished rows take the
next prompt inside the loop (continuous batching, see queue.py). Model state is split once
(`nnx.split`) and passed as a traced argument, so the compiled program is reused across calls
of the same shape.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax.errors import ProveJaxError
from prove_jax import memory
from prove_jax.decoding import queue, steps
from prove_jax.decoding.layouts import LosslessLayout, propose_layout
from prove_jax.decoding.state import LoopState, initial_state
from prove_jax.models.qwen2 import KVCache, StepMask, causal_mask, readable_tokens
from prove_jax.models.sharding import batch_shards

MODES = ("ar", "threshold", "lossless", "verify")
# Prompts are prefilled in chunks of this many tokens inside the compiled program, as many as
# the longest prompt of the rows needs (a queue prefills one admitted row at a time), unless
# DecodeOptions.prefill_chunk says otherwise. A prompt's last chunk is padded, so the chunk
# trades padding against the rows per forward:
# - CPU: prefill is compute-bound at a few dozen rows; 32-token chunks prefilled the first 16
#   HumanEval prompts (63-195 tokens) at the 0.5B shape in 12.5 s at batch 1, 64 in 14.7 s (29% of those
#   tokens were padding), 16 in 13.1 s (benchmarks/prefill.md, AVX2 EPYC).
# - GPU/TPU: a forward of fewer than a few hundred tokens is bound by weight reads, so small
#   chunks only multiply them; 256 is about where bf16 weight reads and compute balance on
#   current accelerators (a roofline estimate, not measured here).
PREFILL_CHUNK = {"cpu": 32}
PREFILL_CHUNK_ACCELERATOR = 256
COMMIT_RULES = ("top1", "prob", "head")
CONFIDENCE_KINDS = ("prob", "entropy", "margin")
# threshold: tau when none is given, per confidence kind. prob: the top-1 probability; margin:
# top-1 minus top-2 probability; entropy: the most entropy (nats) a proposed token may have.
DEFAULT_TAU = {"prob": 0.9, "margin": 0.8, "entropy": 0.5}
# The most tokens one step may feed the proposer per row. The step's intra-step mask is [T, T]
# and its attention scores [G*T, S], so cost grows with T^2; the paper's widest layout (K=16,
# every group served) is 256 tokens wide, and K=500 with every group served would be 250,000
# (a 58 GiB mask, built while tracing). Past this, lower K or cap the mask groups.
MAX_STEP_WIDTH = 4096


class DecodeError(ProveJaxError, ValueError):
    """A decoding request that cannot be served (bad prompt, mode, or model pairing)."""


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    mode: str = "ar"
    block_size: int = 8  # K: tokens proposed per proposer forward
    max_groups: int | None = None  # lossless: mask groups (acceptance lengths served); None = K
    adaptive: bool = False  # lossless: shrink K / groups as the batch grows (see adapt_for_batch)
    # threshold: accept a proposed token while its confidence is >= tau (prob, margin) or its
    # entropy <= tau nats (entropy); None = DEFAULT_TAU of the kind. A tau no token can pass
    # (prob above 1, entropy below 0) decodes exactly like ar.
    tau: float | None = None
    confidence: str = "prob"  # threshold: prob | entropy | margin
    commit_rule: str = "top1"  # verify: top1 | prob | head
    tau_v: float = 0.5  # verify/prob: verifier probability needed to commit a token
    # verify/head: head probability needed to commit a token (None: the head's own, 0.5 as
    # trained); lower commits more per forward, above 1 commits only the exact first token
    head_threshold: float | None = None
    record_steps: bool = False  # keep per-step commit lengths (BatchResult.step_commits)
    prefill_chunk: int | None = None  # prompt tokens per prefill forward; None: default_prefill_chunk()

    def validate(self) -> "DecodeOptions":
        """Checked copy; `ar` is normalised to K=1 (one token per forward, no masks)."""
        if self.mode not in MODES:
            raise DecodeError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        if self.mode == "ar" and self.block_size != 1:
            return dataclasses.replace(self, block_size=1).validate()
        if self.block_size < 1:
            raise DecodeError(f"block size must be >= 1, got {self.block_size}")
        if self.mode == "lossless" and self.block_size < 2:
            raise DecodeError("lossless mode needs --block-size >= 2")
        if self.confidence not in CONFIDENCE_KINDS:
            raise DecodeError(f"unknown confidence {self.confidence!r}; choose from {CONFIDENCE_KINDS}")
        if self.tau is None:
            return dataclasses.replace(self, tau=DEFAULT_TAU[self.confidence]).validate()
        if not math.isfinite(self.tau):
            raise DecodeError(f"tau must be a finite number, got {self.tau}")
        if not (math.isfinite(self.tau_v) and self.tau_v >= 0):
            raise DecodeError(f"tau_v is a verifier probability: it must be >= 0, got {self.tau_v}")
        if self.commit_rule not in COMMIT_RULES:
            raise DecodeError(f"unknown commit rule {self.commit_rule!r}; choose from {COMMIT_RULES}")
        if self.head_threshold is not None and not math.isfinite(self.head_threshold):
            raise DecodeError(f"head threshold must be a finite number, got {self.head_threshold}")
        if self.max_groups is not None and self.max_groups < 1:
            raise DecodeError(f"max groups must be >= 1, got {self.max_groups}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise DecodeError(f"prefill chunk must be >= 1 tokens, got {self.prefill_chunk}")
        return self


def default_prefill_chunk() -> int:
    """Prompt tokens per prefill forward on the default backend (see PREFILL_CHUNK)."""
    return PREFILL_CHUNK.get(jax.default_backend(), PREFILL_CHUNK_ACCELERATOR)


# (max batch, K, groups) for the adaptive lossless setting, per platform; past the last row the
# decoder falls back to K=1 (plain AR), so a step never loses to AR.
# - GPU/TPU: a batch-1 step of up to ~64 tokens costs about one token (decode is bound by
#   weight reads), so wide proposals are nearly free; as the batch grows the step becomes
#   compute bound and the width shrinks (the MARS deferred-KV sampler reached 1.0x at batch 64).
#   Measured on an H200 with the shipped proposer inflated to the Qwen2.5-1.5B shape
#   (benchmarks/h200/decode_adaptive.md): 2.94x AR at batch 1 (K=8/8 groups), 1.52x at batch 4
#   (K=6/4), 1.15x at batch 16 (K=4/2); at batch 16 the batch-1 row's layout (K=8, 8 groups)
#   ran 0.92x (decode_b16.md). The batch 8 and 32 rows are not measured.
# - CPU: even with weight-major matmuls (`model.dense`) a whole lossless step at batch 1 costs
#   1.8x (K=2) to 6.5x (K=8, 3 groups) an AR step for the demo proposer and 1.4x to 2.6x at the
#   Qwen2.5-0.5B shape, on 2 cores (benchmarks/step_cost.md, an AVX-512 EPYC). Whether lossless
#   pays there depends on the machine and above all on the proposer (the self-distilled demo
#   proposer commits 4.4 tokens per forward at K=6 with 2 groups: 1.7x AR at batch 1 on an
#   AVX2 EPYC, about break-even on the faster AVX-512 one; an untrained one commits about 1
#   and would run 3x slower), which a fixed table cannot know: on CPU the table is plain AR,
#   and `calibrate.py` (--calibrate) measures. Measured so on the AVX-512 EPYC with the demo
#   proposer inflated to the 0.5B shape (benchmarks/decode_0.5b_shape.md): calibrated chose
#   K=6/2 groups at batch 1 (1.98x AR), K=2/2 at batch 4 (1.18x) and AR at batch 16.
ADAPTIVE_TABLES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "gpu": ((1, 8, 8), (4, 6, 4), (8, 4, 3), (16, 4, 2), (32, 2, 2)),
    "tpu": ((1, 8, 8), (4, 6, 4), (8, 4, 3), (16, 4, 2), (32, 2, 2)),
    "cpu": (),
}


def adapt_for_batch(options: DecodeOptions, batch: int, platform: str | None = None,
                    table: Sequence[tuple[int, int, int]] | None = None) -> DecodeOptions:
    """The lossless (K, groups) to run at this batch size: from `table` (e.g. measured by
    `calibrate.calibrate`) or this platform's ADAPTIVE_TABLES row; a row with K=1 is plain AR."""
    if options.mode != "lossless" or not options.adaptive:
        return options
    if table is None:
        table = ADAPTIVE_TABLES.get(platform or jax.devices()[0].platform, ADAPTIVE_TABLES["gpu"])
    for max_batch, k, g in table:
        if batch <= max_batch:
            k = min(k, options.block_size)
            if k < 2:
                break
            return dataclasses.replace(options, block_size=k, max_groups=min(g, options.max_groups or g))
    return dataclasses.replace(options, mode="ar", block_size=1)


def check_adaptive_table(table) -> tuple[tuple[int, int, int], ...]:
    """A validated copy of an adaptive table: rows (max_batch, K, groups), batch increasing."""
    rows = tuple(tuple(int(x) for x in row) for row in table)
    for i, row in enumerate(rows):
        if len(row) != 3 or row[0] < 1 or row[1] < 1 or row[2] < 1:
            raise DecodeError(f"adaptive table row {i} must be (max_batch >= 1, K >= 1, groups >= 1), got {row}")
        if i and row[0] <= rows[i - 1][0]:
            raise DecodeError(f"adaptive table rows must have increasing max_batch, got {rows}")
    return rows


def step_shape(options: DecodeOptions) -> tuple[int, int]:
    """(tokens one step feeds the proposer, drafts carried between steps) for validated options."""
    if options.mode == "lossless":
        layout = LosslessLayout.build(options.block_size, options.max_groups)
        return layout.width, layout.num_drafts
    return propose_layout(options.block_size)[0], 1


def check_step_width(options: DecodeOptions, max_buffer: int) -> None:
    """A step of validated `options` fits the model: at most min(`max_buffer`, MAX_STEP_WIDTH)
    tokens per row (a wider step would also reach positions the buffer cannot hold)."""
    width, _ = step_shape(options)
    limit = min(max_buffer, MAX_STEP_WIDTH)
    if width <= limit:
        return
    k = options.block_size
    if options.mode == "lossless":
        groups = LosslessLayout.build(k, options.max_groups).num_groups
        what = f"lossless K={k} with {groups} mask groups feeds {width} tokens per step (1 + {k - 1} x {groups + 1})"
        advice = "lower --block-size or cap the groups with --groups"
    else:
        what = f"--block-size {k} feeds {width} tokens per step ({k} pending + {k - 1} masks)"
        advice = "lower --block-size"
    bound = (f"the model's {max_buffer}-position buffer" if max_buffer <= MAX_STEP_WIDTH
             else f"the {MAX_STEP_WIDTH}-token step limit")
    raise DecodeError(f"{what}, more than {bound}; {advice}")


def decode_step(options: DecodeOptions, model, state: LoopState, eos_ids: jax.Array, *, mask_id: int,
                verifier=None, head=None) -> LoopState:
    """One step of the decode loop for validated `options` (`ar` is threshold with K=1)."""
    k = options.block_size
    if options.mode == "lossless":
        layout = LosslessLayout.build(k, options.max_groups)
        return steps.lossless_step(model, state, eos_ids, layout=layout, mask_id=mask_id)
    if options.mode == "verify":
        return steps.verify_step(model, verifier, state, eos_ids, block_size=k, mask_id=mask_id,
                                 rule=options.commit_rule, tau_v=options.tau_v, head=head,
                                 head_threshold=options.head_threshold)
    return steps.threshold_step(model, state, eos_ids, block_size=k, mask_id=mask_id,
                                tau=options.tau, conf_kind=options.confidence)


def _check_pairing(options: DecodeOptions, cfg, verifier_cfg, head_hidden_size: int | None) -> None:
    """The models a Decoder holds can serve `options` (mask token, verifier, commit head; the
    head's input width, `head_hidden_size`, None without a head)."""
    if options.mode in ("threshold", "lossless", "verify") and cfg.mask_token_id is None:
        raise DecodeError(f"mode {options.mode!r} needs a MARS proposer with a <|mask|> token "
                          f"(config mask_token_id is unset); use --mode ar or a trained proposer")
    if options.mode == "verify":
        if verifier_cfg is None:
            raise DecodeError("mode 'verify' needs a verifier model (--verifier)")
        if options.commit_rule == "head" and head_hidden_size is None:
            raise DecodeError("commit rule 'head' needs a trained commit head in the verifier "
                              "checkpoint (train it with objective=commit_head)")
        if options.commit_rule == "head" and head_hidden_size != verifier_cfg.hidden_size:
            raise DecodeError(f"the commit head reads hidden states of width {head_hidden_size} but "
                              f"the verifier's hidden size is {verifier_cfg.hidden_size}: the head "
                              f"was trained for another verifier")


@dataclasses.dataclass
class BatchResult:
    """Per request (in prompt order) outputs and stats of one `Decoder.generate` call."""
    output_ids: list[list[int]]
    forwards: np.ndarray  # [n] proposer forwards while the request was decoding
    verifier_forwards: np.ndarray  # [n]
    accept_hist: np.ndarray  # [n, K+1]
    seconds: float
    compile_seconds: float
    options: DecodeOptions
    # With options.record_steps: per request, tokens committed by each proposer forward, in
    # order (sums to its output length); lets a caller show the committed blocks.
    step_commits: list[list[int]] | None = None
    loop_steps: int = 0  # iterations of the decode loop (batch steps, all rows together)


def _round_up(x: int, m: int) -> int:
    return max(m, int(math.ceil(x / m)) * m)


class Decoder:
    """Batch decoder for one proposer (and optionally one verifier).

    >>> dec = Decoder(model, eos_ids=[eos], options=DecodeOptions(mode="lossless", block_size=4))
    >>> result = dec.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
    """

    def __init__(self, model, eos_ids: Sequence[int], options: DecodeOptions = DecodeOptions(),
                 verifier=None, commit_head=None, mesh=None, pad_id: int = 0,
                 max_buffer: int | None = None, adaptive_table=None):
        self.options = options.validate()
        # per-batch lossless layouts for options.adaptive (None: the platform's ADAPTIVE_TABLES)
        self.adaptive_table = None if adaptive_table is None else check_adaptive_table(adaptive_table)
        cfg = model.cfg
        self.vcfg = verifier.cfg if verifier is not None else None
        self.head_hidden_size = commit_head.hidden_size if commit_head is not None else None
        _check_pairing(options, cfg, self.vcfg, self.head_hidden_size)
        self.max_buffer = max_buffer or cfg.max_position_embeddings
        check_step_width(self.options, self.max_buffer)
        self.cfg = cfg
        self.graphdef, self.state = nnx.split(model)
        self.vgraphdef, self.vstate = nnx.split(verifier) if verifier is not None else (None, None)
        self.hgraphdef, self.hstate = nnx.split(commit_head) if commit_head is not None else (None, None)
        if mesh is not None and self.hstate is not None:
            # the head is a few KB: replicated, so the program sees every input on the mesh
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self.hstate = jax.device_put(self.hstate, replicated)
        self.eos_ids = np.asarray(list(eos_ids) or [-1], np.int32)
        self.mesh = mesh
        self.pad_id = pad_id
        self._compiled: dict = {}
        self.trace_count = 0

    def with_options(self, options: DecodeOptions) -> "Decoder":
        """The same models and settings decoding with other options (its own compile cache)."""
        options = options.validate()
        _check_pairing(options, self.cfg, self.vcfg, self.head_hidden_size)
        check_step_width(options, self.max_buffer)
        other = copy.copy(self)
        other.options = options
        other._compiled = {}
        other.trace_count = 0
        return other

    # ---- shapes -----------------------------------------------------------------------------

    def buffer_len(self, prompt_width: int, max_new_tokens: int) -> int:
        return _round_up(prompt_width + max_new_tokens, 64)

    def rows(self, batch_size: int, num_requests: int) -> int:
        """Rows a call decodes with: `batch_size`, but no more than the requests it queues (a
        row with no request would be computed every step for nothing, and would steer the
        adaptive layout toward a larger batch), rounded up to whole shards of the data axis."""
        return _round_up(min(batch_size, num_requests), self._data_size())

    def _data_size(self) -> int:
        return 1 if self.mesh is None else batch_shards(self.mesh)

    # ---- the compiled program ---------------------------------------------------------------

    def _build(self, options: DecodeOptions, n_rows: int, n_slots: int):
        """The jitted program: prefill rows, then one while_loop that decodes and refills them.

        Takes the request queue (prompts [Q, P], prompt_len [Q], max_new [Q]) and serves it with
        n_rows rows; Q == n_rows is a plain static batch. Requests past the last one with a
        budget (padding) are never admitted.
        """
        k = options.block_size
        mask_id = -1 if self.cfg.mask_token_id is None else int(self.cfg.mask_token_id)
        eos_ids = self.eos_ids
        width, n_drafts = step_shape(options)
        pad_id = self.pad_id
        graphdef, vgraphdef, hgraphdef = self.graphdef, self.vgraphdef, self.hgraphdef
        chunk_size = options.prefill_chunk or default_prefill_chunk()

        def run(state, vstate, hstate, prompts, prompt_len, max_new):
            self.trace_count += 1  # runs only while tracing: counts compilations
            model = nnx.merge(graphdef, state)
            verifier = nnx.merge(vgraphdef, vstate) if vgraphdef is not None else None
            head = nnx.merge(hgraphdef, hstate) if hgraphdef is not None else None
            q, p = prompts.shape
            b = n_rows
            eos = jnp.asarray(eos_ids)

            def prefill(m, toks, plen, size):
                """Cache of `size` slots holding the prompts' KV, written `chunk_size` tokens at a
                time up to the longest prompt of these rows: prefill costs what the prompts
                are long, not the padded prompt width of the whole run."""
                r = toks.shape[0]
                c = min(p, chunk_size)
                toks = jnp.pad(toks, ((0, 0), (0, -p % c)), constant_values=pad_id)
                causal = causal_mask(1, c)

                def chunk(i, cache):
                    start = i * c
                    ids = jax.lax.dynamic_slice_in_dim(toks, start, c, axis=1)
                    pos = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None], (r, c))
                    # Real tokens see the earlier chunks and the causal part of this one; keys
                    # past a prompt's end are padding, hidden. (Padding queries see garbage: their
                    # KV lies past the prompt and is overwritten by decoding.)
                    valid = pos[:, None, :] < plen[:, None, None]
                    mask = StepMask(jnp.full((r,), start, jnp.int32), causal & valid)
                    if pad_id >= m.cfg.vocab_size:  # past a verifier's rows (prompt ids: checked)
                        ids = readable_tokens(ids, m.cfg.vocab_size)[0]
                    return m.hidden_states(ids, pos, mask, cache)[1]

                n_chunks = (jnp.max(plen) + c - 1) // c
                return jax.lax.fori_loop(0, n_chunks, chunk, KVCache.zeros(m.cfg, r, size))

            def start_rows(toks, plen, mnew):
                """Loop state of len(toks) rows right after their prefill."""
                tokens = jnp.full((toks.shape[0], n_slots), pad_id, jnp.int32).at[:, :p].set(toks)
                cache = prefill(model, toks, plen, n_slots + width)
                vcache = prefill(verifier, toks, plen, n_slots + k) if verifier is not None else None
                return initial_state(tokens, plen, mnew, cache, vcache, num_drafts=n_drafts,
                                     block_size=k, pad_id=pad_id, record_steps=options.record_steps)

            def admit(r):
                one = lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1, 0)  # noqa: E731
                return start_rows(one(prompts), one(prompt_len), one(max_new))

            st = start_rows(prompts[:b], prompt_len[:b], max_new[:b])
            qs = queue.start(q, st)
            # requests after the last one with a budget are padding: never admitted
            n_live = jnp.max(jnp.where(max_new > 0, jnp.arange(q, dtype=jnp.int32) + 1, 0))

            def body(carry):
                st, qs = carry
                if q > b:
                    st, qs = queue.refill(st, qs, n_live, admit)
                st = decode_step(options, model, st, eos, mask_id=mask_id, verifier=verifier, head=head)
                return st.replace(step=st.step + 1), qs

            # every active step commits >= 1 token: a safety bound, never the reason to stop
            bound = jnp.sum(max_new) + q

            def more(carry):
                st, qs = carry
                return (st.step < bound) & (~jnp.all(st.done) | (qs.next_req < n_live))

            st, qs = jax.lax.while_loop(more, body, (st, qs))
            qs = queue.finish(st, qs)
            return (qs.tokens, qs.length, qs.forwards, qs.verifier_forwards, qs.accept_hist,
                    qs.step_commits, st.step)

        if self.mesh is None:
            return jax.jit(run)
        # Outputs (token ids and counters, a few KB) replicated, so that every process of a
        # multi-host mesh can read all of them (np.asarray fails on an array with shards on
        # another host). Sharding propagation chose that too where checked; this makes it sure.
        return jax.jit(run, out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _compiled_for(self, options, b, q, p, n_slots, args):
        key = (options, b, q, p, n_slots)
        if key not in self._compiled:
            t0 = time.perf_counter()
            fn = self._build(options, b, n_slots)
            compiled = fn.lower(*args).compile()
            self._compiled[key] = (compiled, time.perf_counter() - t0)
            return compiled, self._compiled[key][1]
        return self._compiled[key][0], 0.0

    # ---- public API -------------------------------------------------------------------------

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      names: Sequence | None = None) -> None:
        """Every prompt can be decoded; errors name a prompt by `names[i]` (request ids) if given."""
        if not prompts:
            raise DecodeError("no prompts given")
        for i, p in enumerate(prompts):
            what = f"prompt {i}" if names is None else f"request {names[i]!r}"
            if len(p) == 0:
                raise DecodeError(f"{what} is empty: decoding needs at least one prompt token")
            bad = [t for t in p if not 0 <= int(t) < self.vocab_limit]
            if bad:
                raise DecodeError(f"{what} has token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.vocab_limit})" + self._vocab_limit_why())
            if len(p) + max_new_tokens > self.max_buffer:
                raise DecodeError(f"{what} has {len(p)} tokens; with max_new_tokens="
                                  f"{max_new_tokens} it needs {len(p) + max_new_tokens} positions, "
                                  f"longer than the buffer limit {self.max_buffer}")

    @property
    def vocab_limit(self) -> int:
        """Prompt ids must be below this: the proposer's embedding rows, and in verify mode
        also the verifier's, which reads the prompts too."""
        if self.options.mode == "verify" and self.vcfg is not None:
            return min(self.cfg.vocab_size, self.vcfg.vocab_size)
        return self.cfg.vocab_size

    def _vocab_limit_why(self) -> str:
        if self.vocab_limit < self.cfg.vocab_size:
            return f" (the verifier has {self.vcfg.vocab_size} embedding rows)"
        return ""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batch_size: int | None = None, prompt_width: int | None = None,
                 queue_size: int | None = None) -> BatchResult:
        """Greedy-family decoding of `prompts` with `batch_size` rows (default: one row each).

        More prompts than rows are queued and served by continuous batching inside the one
        compiled loop: a row that finishes takes the next prompt at once. `prompt_width` pads
        every call to one prompt width and `queue_size` pads the queue, so the calls of a run
        share one program.
        """
        if max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size is not None and batch_size < 1:
            raise DecodeError(f"batch size must be >= 1, got {batch_size}")
        self.check_prompts(prompts, max_new_tokens)
        n = len(prompts)
        b = self.rows(batch_size or n, max(n, queue_size or 0))
        q = _round_up(max(n, queue_size or 0), b)  # a whole number of rows: shards like the batch
        options = adapt_for_batch(self.options, b, table=self.adaptive_table)
        p = _round_up(max([len(x) for x in prompts] + [prompt_width or 0]), 16)
        n_slots = self.buffer_len(p, max_new_tokens)
        arr = np.full((q, p), self.pad_id, np.int32)
        plen = np.ones((q,), np.int32)
        max_new = np.zeros((q,), np.int32)  # padding requests get no budget: never decoded
        for i, x in enumerate(prompts):
            arr[i, : len(x)] = x
            plen[i] = len(x)
            max_new[i] = max_new_tokens
        args = [self.state, self.vstate, self.hstate, arr, plen, max_new]
        if self.mesh is not None:
            batch_sharding = jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec(tuple(a for a in ("data", "fsdp") if a in self.mesh.shape)))
            args[3:] = [jax.device_put(x, batch_sharding) for x in args[3:]]
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with ctx:
            compiled, compile_s = self._compiled_for(options, b, q, p, n_slots, args)
            memory.check_fits(compiled, memory.local_devices(self.mesh),
                              f"decoding {b} rows x {n_slots} cache slots (KV caches and loop state, "
                              f"beyond the weights)", error=DecodeError,
                              advice="lower --batch-size or --max-new-tokens, or shard the batch "
                                     "over more devices")
            t0 = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            seconds = time.perf_counter() - t0
        tokens, length, fwd, vfwd, hist = (np.asarray(x) for x in out[:5])
        outputs = [tokens[i, plen[i]: length[i]].tolist() for i in range(n)]
        step_commits = None
        if out[5] is not None:
            trace = np.asarray(out[5])
            step_commits = [trace[i, : fwd[i]].tolist() for i in range(n)]
        return BatchResult(output_ids=outputs, forwards=fwd[:n], verifier_forwards=vfwd[:n],
                           accept_hist=hist[:n], seconds=seconds, compile_seconds=compile_s,
                           options=options, step_commits=step_commits, loop_steps=int(out[6]))

