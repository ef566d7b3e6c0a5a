"""The batch decoder: checks requests, pads them to a program shape, and runs the compiled
decode program (program.py), one per (settings, queue size, prompt width).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from prove_jax import memory
from prove_jax.decoding import program
from prove_jax.decoding.adaptive import adapt_for_batch, check_adaptive_table
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import (
    MAX_STEP_WIDTH,
    DecodeError,
    DecodeOptions,
    default_prefill_chunk,
)
from prove_jax.decoding.program import ProgramSettings, step_shape
from prove_jax.decoding.queue import Requests
from prove_jax.decoding.sampling import GREEDY, RowSampling, Sampler, SamplingParams
from prove_jax.decoding.stream import DecodeStream
from prove_jax.models.paged import pages_needed, pooled
from prove_jax.models.qwen2 import stack_layers, unstack_layers
from prove_jax.models.sharding import ROW_SPLIT_RULES, batch_shards, kv_per_device, kv_rules


def check_step_width(options: DecodeOptions, max_buffer: int) -> None:
    """A step of validated `options` fits the model: at most min(`max_buffer`, MAX_STEP_WIDTH)
    tokens per row (a wider step would also reach positions the buffer cannot hold)."""
    width, _ = step_shape(options)
    limit = min(max_buffer, MAX_STEP_WIDTH)
    if width <= limit:
        return
    k = options.block_size
    if options.mode == "lossless":
        groups = LosslessLayout.build(k, options.lossless.max_groups).num_groups
        what = (
            f"lossless K={k} with {groups} mask groups feeds {width} tokens per step "
            f"(1 + {k - 1} x {groups + 1})"
        )
        advice = "lower --block-size or cap the groups with --groups"
    else:
        what = f"--block-size {k} feeds {width} tokens per step ({k} pending + {k - 1} masks)"
        advice = "lower --block-size"
    bound = (f"the model's {max_buffer}-position buffer" if max_buffer <= MAX_STEP_WIDTH
             else f"the {MAX_STEP_WIDTH}-token step limit")
    raise DecodeError(f"{what}, more than {bound}; {advice}")


def _check_pairing(options: DecodeOptions, cfg, verifier_cfg, head_hidden_size: int | None) -> None:
    """The models a Decoder holds can serve `options` (mask token, verifier, commit head; the
    head's input width, `head_hidden_size`, None without a head)."""
    if options.mode in ("threshold", "lossless", "verify") and cfg.mask_token_id is None:
        raise DecodeError(f"mode {options.mode!r} needs a MARS proposer with a <|mask|> token "
                          f"(config mask_token_id is unset); use --mode ar or a trained proposer")
    if options.mode == "verify":
        if verifier_cfg is None:
            raise DecodeError("mode 'verify' needs a verifier model (--verifier)")
        if options.verify.commit_rule == "head" and head_hidden_size is None:
            raise DecodeError("commit rule 'head' needs a trained commit head in the verifier "
                              "checkpoint (train it with objective=commit_head)")
        if options.verify.commit_rule == "head" and head_hidden_size != verifier_cfg.hidden_size:
            raise DecodeError(
                f"the commit head reads hidden states of width {head_hidden_size} but "
                f"the verifier's hidden size is {verifier_cfg.hidden_size}: the head "
                f"was trained for another verifier"
            )


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
    # "stop" (the output ends with EOS or one of the request's stop_token_ids) or "length"
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    # With options.logprobs: per request and output token, (logprob, [(id, logprob), ...] of the
    # most likely tokens there), under the distribution the token was committed from.
    logprobs: list[list[tuple[float, list[tuple[int, float]]]]] | None = None
    seeds: list[int] = dataclasses.field(default_factory=list)  # each request's seed, as used


@dataclasses.dataclass
class _Call:
    settings: ProgramSettings
    requests: Requests
    seeds: list[int]


def _attention_resolved(options: DecodeOptions) -> DecodeOptions:
    """`options` with attention "auto" resolved to this process's fast path, here where the
    decoder is built: after a multi-host job has joined (asking for the backend first would
    start it, and `jax.distributed.initialize` must come before that)."""
    compute = options.compute.resolve_attention()
    return options if compute is options.compute else dataclasses.replace(options, compute=compute)


def _split(model, scan_layers: bool):
    """(graph definition, state) of `model` with its layers stacked (`scan_layers`) or per layer."""
    if model.layers_stacked != scan_layers:
        model = stack_layers(model) if scan_layers else unstack_layers(model)
    return nnx.split(model)


def request_seed(base: int, index: int) -> int:
    """The seed of a request that gives none: a hash of the call's (or job's) `base` seed and
    the request's `index`, so requests differ and a rerun repeats them."""
    return int(np.random.SeedSequence([base, index]).generate_state(1)[0])


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
        self.options = _attention_resolved(options.validate())
        # per-batch lossless layouts for options.lossless.adaptive (None: the platform's
        # ADAPTIVE_TABLES)
        self.adaptive_table = (
            None if adaptive_table is None else check_adaptive_table(adaptive_table)
        )
        cfg = model.cfg
        self.verifier_cfg = verifier.cfg if verifier is not None else None
        self.head_hidden_size = commit_head.hidden_size if commit_head is not None else None
        _check_pairing(self.options, cfg, self.verifier_cfg, self.head_hidden_size)
        self.max_buffer = max_buffer or cfg.max_position_embeddings
        check_step_width(self.options, self.max_buffer)
        self.cfg = cfg
        self.graphdef, self.state = _split(model, self.options.memory.scan_layers)
        self.verifier_graphdef, self.verifier_state = (
            _split(verifier, self.options.memory.scan_layers)
            if verifier is not None else (None, None))
        self.head_graphdef, self.head_state = (
            nnx.split(commit_head) if commit_head is not None else (None, None)
        )
        if mesh is not None and self.head_state is not None:
            # the head is a few KB: replicated, so the program sees every input on the mesh
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self.head_state = jax.device_put(self.head_state, replicated)
        self.eos_ids = np.asarray(list(eos_ids) or [-1], np.int32)
        self.mesh = mesh
        self.pad_id = pad_id
        # every program this decoder compiled, generate's and stream's: key -> (compiled, seconds);
        # a key starts with the program's name ("run": generate's whole decode)
        self._programs: dict = {}

    @property
    def trace_count(self) -> int:
        """Programs `generate` has compiled on this decoder (each was traced once)."""
        return len(self.programs("run"))

    @property
    def program_count(self) -> int:
        """Programs this decoder has compiled, `generate`'s and `stream`'s."""
        return len(self._programs)

    def programs(self, name: str) -> list[tuple[tuple, object]]:
        """(key, compiled program) of each program named `name` this decoder has compiled:
        "run" (`generate`), or `stream`'s "start", "chunk" and "admit"."""
        return [(key, entry[0]) for key, entry in self._programs.items() if key[0] == name]

    def check_fits(self, compiled, rows: int, slots: int) -> None:
        """Refuse a decode program of `rows` rows x `slots` cache slots that cannot fit this
        decoder's devices beside the weights (a DecodeError saying what to lower)."""
        memory.check_fits(
            compiled,
            memory.local_devices(self.mesh),
            f"decoding {rows} rows x {slots} cache slots (KV caches and loop state, "
            f"beyond the weights)",
            error=DecodeError,
            advice="lower --batch-size or --max-new-tokens, or shard the batch over more devices",
        )

    def compile_once(self, key: tuple, build) -> tuple[object, float]:
        """(the program `key` names, seconds spent compiling it now: 0 when it was cached);
        `build()` lowers and compiles it the first time."""
        if key in self._programs:
            return self._programs[key][0], 0.0
        start = time.perf_counter()
        compiled = build()
        self._programs[key] = (compiled, time.perf_counter() - start)
        return self._programs[key]

    def with_options(self, options: DecodeOptions) -> "Decoder":
        """The same models and settings decoding with other options (its own compile cache)."""
        options = _attention_resolved(options.validate())
        _check_pairing(options, self.cfg, self.verifier_cfg, self.head_hidden_size)
        check_step_width(options, self.max_buffer)
        other = copy.copy(self)
        other.options = options
        # the weights in the other layout
        if options.memory.scan_layers != self.options.memory.scan_layers:
            other.graphdef, other.state = _split(
                nnx.merge(self.graphdef, self.state), options.memory.scan_layers
            )
            if self.verifier_graphdef is not None:
                other.verifier_graphdef, other.verifier_state = _split(
                    nnx.merge(self.verifier_graphdef, self.verifier_state),
                    options.memory.scan_layers)
        other._programs = {}
        return other

    # ---- shapes -----------------------------------------------------------------------------

    def buffer_len(self, prompt_width: int, max_new_tokens: int) -> int:
        return _round_up(prompt_width + max_new_tokens, 64)

    def rows(self, batch_size: int, num_requests: int) -> int:
        """Rows a call decodes with: `batch_size`, but no more than the requests it queues (a
        row with no request would be computed every step for nothing, and would steer the
        adaptive layout toward a larger batch), rounded up to whole shards of the data axis.
        With contiguous caches on a mesh whose tensor axis cannot split a model's kv heads, up
        to whole shards of data x tensor instead where that lowers the KV each device holds:
        that model's cache then splits over rows (`sharding.kv_rules`), so 12 rows of a 2-head
        verifier on v6e-8 become 16 and each chip holds 2 rows' cache, not 12. A paged pool keeps
        the rows asked for (at whole shards of data x tensor such a verifier keeps a contiguous
        cache split over rows beside it, as on TPU does one whose head dim is under 128 lanes:
        `paged.pooled`)."""
        rows = _round_up(min(batch_size, num_requests), self.data_shards())
        if self.mesh is None or self.options.memory.page_size is not None:
            return rows
        split = _round_up(rows, batch_shards(self.mesh, ROW_SPLIT_RULES))
        return split if self._kv_per_device(split) < self._kv_per_device(rows) else rows

    def data_shards(self) -> int:
        """Data shards the rows split over (1 without a mesh)."""
        return 1 if self.mesh is None else batch_shards(self.mesh)

    def admission_shards(self, rows: int) -> int:
        """The finest split of a batch of `rows` rows: the data shards, or data x tensor where a
        contiguous cache splits over rows (`sharding.kv_rules`). An admission of a multiple of
        that many requests comes in that many blocks, else in one per data shard; block j holds
        the requests for rows of shard j, so each is prefilled and written on the devices that
        hold its row (`program.admit_rows`, stream.py)."""
        if self.mesh is None:
            return 1
        shards = self.data_shards()
        cfgs = (self.cfg, self.verifier_cfg) if self.verifier_cfg is not None else (self.cfg,)
        # a verifier's contiguous cache (paged.pooled)
        if self.options.memory.page_size is not None:
            cfgs = tuple(c for c in cfgs[1:]
                         if not pooled(c, rows, self.options.compute, self.mesh))
        if cfgs:
            shards = max(
                [shards]
                + [batch_shards(self.mesh, kv_rules(c.num_kv_heads, rows, self.mesh)) for c in cfgs]
            )
        return shards

    def _kv_per_device(self, rows: int) -> int:
        """KV elements per cache slot one device holds at `rows` rows, both models' caches."""
        cfgs = (self.cfg, self.verifier_cfg) if self.options.mode == "verify" else (self.cfg,)
        return sum(
            c.num_layers * c.head_dim * kv_per_device(c.num_kv_heads, rows, self.mesh) for c in cfgs
        )

    # ---- the compiled program ---------------------------------------------------------------

    def program_settings(
        self, options: DecodeOptions, num_rows: int, num_slots: int
    ) -> ProgramSettings:
        """The static settings of the program that decodes `num_rows` rows of `num_slots` slots."""
        return ProgramSettings(
            options=options, num_rows=num_rows, num_slots=num_slots,
            pad_id=self.pad_id,
            mask_id=-1 if self.cfg.mask_token_id is None else int(self.cfg.mask_token_id),
            prefill_chunk=options.memory.prefill_chunk or default_prefill_chunk())

    def _build(self, settings: ProgramSettings):
        """`program.run_program` jitted with this decoder's graph definitions and `settings`
        bound."""
        run = functools.partial(program.run_program, self.graphdef, self.verifier_graphdef,
                                self.head_graphdef, settings)
        if self.mesh is None:
            return jax.jit(run)
        # Outputs (token ids and counters, a few KB) replicated, so that every process of a
        # multi-host mesh can read all of them (np.asarray fails on an array with shards on
        # another host).
        return jax.jit(
            run, out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )

    def _compiled_for(self, settings: ProgramSettings, args):
        """(compiled program, seconds spent compiling it now: 0 when it was cached)."""
        requests = args[3]
        key = ("run", settings, requests.prompts.shape, requests.stop_ids.shape)
        return self.compile_once(key, lambda: self._build(settings).lower(*args).compile())

    # ---- public API -------------------------------------------------------------------------

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                      names: Sequence | None = None) -> None:
        """Every prompt can be decoded with its budget (one for all, or one per prompt); errors
        name a prompt by `names[i]` (request ids) if given."""
        if not prompts:
            raise DecodeError("no prompts given")
        budgets = (
            [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
        )
        for i, (p, budget) in enumerate(zip(prompts, budgets)):
            problem = self.prompt_problem(p, budget)
            if problem is not None:
                what = f"prompt {i}" if names is None else f"request {names[i]!r}"
                raise DecodeError(f"{what} {problem}")

    def prompt_problem(self, prompt: Sequence[int], max_new_tokens: int) -> str | None:
        """Why this decoder cannot decode `prompt` (a phrase following "request X"), or None."""
        if isinstance(prompt, str) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            return ("is not a list of token ids: the Decoder takes ids (for text in and out, with "
                    "stop strings, use prove_jax.decoding.text.TextGenerator)")
        if len(prompt) == 0:
            return "is empty: decoding needs at least one prompt token"
        bad = [t for t in prompt if not 0 <= int(t) < self.vocab_limit]
        if bad:
            return (f"has token id {bad[0]} outside the vocabulary [0, {self.vocab_limit})"
                    + self._vocab_limit_why())
        if len(prompt) + max_new_tokens > self.max_buffer:
            fix = (f"lower max_new_tokens to {self.max_buffer - len(prompt)} or shorten the prompt"
                   if len(prompt) < self.max_buffer else "shorten the prompt")
            return (f"has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(prompt) + max_new_tokens} positions, longer than the buffer limit "
                    f"{self.max_buffer}: {fix} (generate: --truncate left|right cuts it)")
        return self._pool_problem(len(prompt), max_new_tokens)

    @property
    def vocab_limit(self) -> int:
        """Prompt ids must be below this: the proposer's embedding rows, and in verify mode
        also the verifier's, which reads the prompts too."""
        if self.options.mode == "verify" and self.verifier_cfg is not None:
            return min(self.cfg.vocab_size, self.verifier_cfg.vocab_size)
        return self.cfg.vocab_size

    def _vocab_limit_why(self) -> str:
        if self.vocab_limit < self.cfg.vocab_size:
            return f" (the verifier has {self.verifier_cfg.vocab_size} embedding rows)"
        return ""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batch_size: int | None = None, prompt_width: int | None = None,
                 queue_size: int | None = None,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 seed: int = 0) -> BatchResult:
        """Decode `prompts` with `batch_size` rows (default: one row each).

        More prompts than rows are queued and served by continuous batching inside the one
        compiled loop: a row that finishes takes the next prompt at once. `prompt_width` pads
        every call to one prompt width and `queue_size` pads the queue, so the calls of a run
        share one program. `params` (one for all prompts or one each; default greedy) set
        sampling, a request's own `max_new_tokens` and its stop tokens; a request without a
        seed gets `request_seed(seed, i)`. Stop strings need text: they are refused here
        (`text.TextGenerator` finds them).
        """
        call = self._call(
            prompts, max_new_tokens, batch_size, prompt_width, queue_size, params, seed
        )
        settings, requests, seeds, n = call.settings, call.requests, call.seeds, len(prompts)
        rows, num_slots = settings.num_rows, settings.num_slots
        args = [self.state, self.verifier_state, self.head_state, requests]
        if self.mesh is not None:
            args[3] = jax.device_put(args[3], self.batch_sharding())
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            compiled, compile_seconds = self._compiled_for(settings, args)
            self.check_fits(compiled, rows, num_slots)
            start = time.perf_counter()
            out, loop_steps = jax.block_until_ready(compiled(*args))
            seconds = time.perf_counter() - start
        out = jax.tree.map(np.asarray, out)
        prompt_len, length, forwards = np.asarray(requests.prompt_len), out.length, out.forwards
        outputs = [out.tokens[i, prompt_len[i]: length[i]].tolist() for i in range(n)]
        step_commits = None
        if out.step_commits is not None:
            step_commits = [out.step_commits[i, : forwards[i]].tolist() for i in range(n)]
        stop_ids = np.asarray(requests.stop_ids)
        finish = ["stop" if o and o[-1] in stop_ids[i] else "length" for i, o in enumerate(outputs)]
        logprobs = None
        if out.logprobs is not None:
            lp = out.logprobs
            logprobs = [
                [
                    (
                        float(lp.chosen[i, s]),
                        list(zip(lp.top_ids[i, s].tolist(), lp.top_logprobs[i, s].tolist())),
                    )
                    for s in range(prompt_len[i], length[i])
                ]
                for i in range(n)
            ]
        return BatchResult(
            output_ids=outputs,
            forwards=forwards[:n],
            verifier_forwards=out.verifier_forwards[:n],
            accept_hist=out.accept_hist[:n],
            seconds=seconds,
            compile_seconds=compile_seconds,
            options=settings.options,
            step_commits=step_commits,
            loop_steps=int(loop_steps),
            finish_reasons=finish,
            logprobs=logprobs,
            seeds=seeds,
        )

    def _call(
        self, prompts, max_new_tokens, batch_size, prompt_width, queue_size, params, seed
    ) -> "_Call":
        """The program settings and request arrays of a `generate` call (checked)."""
        params, budgets, seeds = self._prepare(prompts, max_new_tokens, batch_size, params, seed)
        n = len(prompts)
        rows = self.rows(batch_size or n, max(n, queue_size or 0))
        num_requests = _round_up(max(n, queue_size or 0), rows)  # whole rows: shards like the batch
        options = adapt_for_batch(self.options, rows, table=self.adaptive_table)
        width = _round_up(max([len(x) for x in prompts] + [prompt_width or 0]), 16)
        num_slots = self.buffer_len(width, max(budgets))
        requests = self._request_arrays(prompts, budgets, params, seeds, num_requests, width)
        settings = dataclasses.replace(self.program_settings(options, rows, num_slots),
                                       sampler=Sampler.for_requests(params),
                                       num_pages=self._pool_pages(prompts, budgets, rows))
        return _Call(settings, requests, seeds)

    def lower(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        batch_size: int | None = None,
        prompt_width: int | None = None,
        queue_size: int | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ):
        """The program `generate` would run for these arguments, lowered (`jax.stages.Lowered`)
        but not compiled or run: for an ahead-of-time compile, where the weights may be
        abstract (`jax.ShapeDtypeStruct`s with shardings) and the mesh a TPU topology's."""
        call = self._call(prompts, max_new_tokens, batch_size, prompt_width, queue_size, params, 0)
        requests = call.requests
        if self.mesh is not None:  # placed abstractly: the mesh's devices may not be attached
            batch = self.batch_sharding()
            requests = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch), requests
            )
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return self._build(call.settings).lower(
                self.state, self.verifier_state, self.head_state, requests
            )

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        batch_size: int | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        seed: int = 0,
        chunk_steps: int = 16,
        log=None,
    ) -> "DecodeStream":
        """Decode `prompts` with `batch_size` rows (default 1), yielding as it goes.

        `for event in decoder.stream(...)`: each `StreamEvent` holds a request's newly committed
        tokens and, when it finished, its `RequestOutput`. The host runs up to `chunk_steps`
        compiled steps at a time and admits waiting requests into free rows between chunks,
        prefilled together (stream.py). `params` and `seed` are as in `generate`; `log` gets a
        line before each compile.
        """
        if chunk_steps < 1:
            raise DecodeError(f"chunk steps must be >= 1, got {chunk_steps}")
        params, budgets, seeds = self._prepare(prompts, max_new_tokens, batch_size, params, seed)
        n = len(prompts)
        rows = self.rows(batch_size or 1, n)
        options = adapt_for_batch(self.options, rows, table=self.adaptive_table)
        width = _round_up(max(len(x) for x in prompts), 16)
        # one request more, with no budget: what a row with no request holds
        requests = self._request_arrays(list(prompts) + [[self.pad_id]], budgets + [0],
                                        params + [GREEDY], seeds + [0], n + 1, width)
        settings = dataclasses.replace(
            self.program_settings(options, rows, self.buffer_len(width, max(budgets))),
            sampler=Sampler.for_requests(params),
            num_pages=self._pool_pages(prompts, budgets, rows),
        )
        return DecodeStream(self, requests, seeds, settings, chunk_steps, log)

    def _prepare(self, prompts, max_new_tokens: int, batch_size: int | None, params, seed: int):
        """What `generate` and `stream` both check and derive: each request's validated
        SamplingParams, token budget and seed."""
        if max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size is not None and batch_size < 1:
            raise DecodeError(f"batch size must be >= 1, got {batch_size}")
        params = _per_request(params, len(prompts))
        if any(p.stop for p in params):
            raise DecodeError(
                "stop strings are found on text, which the Decoder does not see (it would "
                "ignore them): use prove_jax.decoding.text.TextGenerator, or stop_token_ids"
            )
        budgets = [p.max_new_tokens or max_new_tokens for p in params]
        self.check_prompts(prompts, budgets)
        seeds = [
            p.seed if p.seed is not None else request_seed(seed, i) for i, p in enumerate(params)
        ]
        if self.options.lossless.relaxed_p is not None and Sampler.for_requests(params) is not None:
            raise DecodeError("relaxed acceptance (--relaxed-p) is for greedy decoding; sampled "
                              "lossless is exact speculative sampling: drop one or the other")
        return params, budgets, seeds

    def pages_needed(self, prompt_len, budget) -> np.ndarray:
        """Pages of the paged KV pool each request (prompt lengths and budgets, one or an array
        each) owns while it decodes; 0 without a pool (`paged.pages_needed`)."""
        page = self.options.memory.page_size
        if page is None:
            return np.zeros(np.shape(prompt_len), np.int32)
        return np.asarray(pages_needed(np.asarray(prompt_len), np.asarray(budget), page))

    def _pool_pages(self, prompts, budgets, rows: int) -> int:
        """Pages of the paged KV pool for a call: options.memory.kv_pages (rounded up to whole pools
        for the data shards: each shard's rows have a pool of their own), or enough for `rows` rows
        at the longest request; 0 without a pool. `check_prompts` has made sure every request
        fits one shard's pool (`_pool_problem`)."""
        if self.options.memory.page_size is None:
            return 0
        if self.options.memory.kv_pages is None:
            return rows * int(self.pages_needed([len(p) for p in prompts], budgets).max())
        return self.pages_per_shard() * self.data_shards()

    def pages_per_shard(self) -> int:
        """Pages of each data shard's pool with options.memory.kv_pages (split evenly, rounded
        up)."""
        return -(-self.options.memory.kv_pages // self.data_shards())

    def _pool_problem(self, prompt_len: int, budget: int) -> str | None:
        """Why a request of `prompt_len` tokens and `budget` new ones can never be admitted to
        the paged pool options.memory.kv_pages sizes (a phrase following "request X"), or None."""
        if self.options.memory.page_size is None or self.options.memory.kv_pages is None:
            return None
        need, per_shard = int(self.pages_needed(prompt_len, budget)), self.pages_per_shard()
        if need <= per_shard:
            return None
        shards = self.data_shards()
        pool = (
            f"the pool's {per_shard}"
            if shards == 1
            else (
                f"each of the {shards} data shards' pools "
                f"({per_shard} of --kv-pages {self.options.memory.kv_pages})"
            )
        )
        return (
            f"needs {need} KV pages of {self.options.memory.page_size} slots "
            f"({prompt_len} prompt tokens "
            f"+ {budget} new), more than {pool}: raise --kv-pages or lower --max-new-tokens"
        )

    def batch_sharding(self):
        """Requests and rows split over the mesh's batch axes; None without a mesh."""
        if self.mesh is None:
            return None
        return jax.sharding.NamedSharding(
            self.mesh,
            jax.sharding.PartitionSpec(tuple(a for a in ("data", "fsdp") if a in self.mesh.shape)),
        )

    def _request_arrays(
        self, prompts, budgets, params, seeds, num_requests: int, width: int
    ) -> Requests:
        """The queue as host arrays; padding requests get no budget, so they are never decoded."""
        n = len(prompts)
        queued = np.full((num_requests, width), self.pad_id, np.int32)
        prompt_len = np.ones((num_requests,), np.int32)
        max_new = np.zeros((num_requests,), np.int32)
        eos = [int(x) for x in self.eos_ids if x >= 0]
        stops = [eos + [t for t in p.stop_token_ids if t not in eos] for p in params]
        stop_ids = np.full((num_requests, max(1, max(len(s) for s in stops))), -1, np.int32)
        for i, x in enumerate(prompts):
            queued[i, : len(x)] = x
            prompt_len[i] = len(x)
            max_new[i] = budgets[i]
            stop_ids[i, : len(stops[i])] = stops[i]
        sampling = None
        if Sampler.for_requests(params) is not None:
            pad = [GREEDY] * (num_requests - n)
            sampling = RowSampling.from_params(list(params) + pad, list(seeds) + [0] * len(pad))
        return Requests(prompts=queued, prompt_len=prompt_len, max_new=max_new, stop_ids=stop_ids,
                        sampling=sampling)


def _per_request(params, n: int) -> list[SamplingParams]:
    """`params` (None, one, or one per request) as n validated SamplingParams."""
    if params is None:
        return [GREEDY] * n
    if isinstance(params, SamplingParams):
        return [params.validate()] * n
    params = list(params)
    if len(params) != n:
        raise DecodeError(
            f"{len(params)} sampling params for {n} prompts; give one, or one per prompt"
        )
    return [p.validate() for p in params]
