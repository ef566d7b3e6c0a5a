"""What a decode call may ask for: `DecodeOptions`, its allowed values and defaults."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import jax

from prove_jax.errors import ProveJaxError
from prove_jax.models.kernels import DEFAULT_KERNELS, KernelOptions

MODES = ("ar", "threshold", "lossless", "verify")
COMMIT_RULES = ("top1", "prob", "head")
CONFIDENCE_KINDS = ("prob", "entropy", "margin")
# threshold: tau when none is given, per confidence kind
DEFAULT_TAU = MappingProxyType({"prob": 0.9, "margin": 0.8, "entropy": 0.5})
# Most tokens one step may feed the proposer per row: the step's mask is [T, T], built while
# tracing (lossless K=500 with every group served would be 250,000 wide, a 58 GiB mask).
MAX_STEP_WIDTH = 4096
# Prompt tokens per prefill forward. CPU: prefill is compute-bound, and a short chunk pads
# less (benchmarks/prefill.md); accelerators: a forward of a few hundred tokens costs about
# what reading the weights does, so shorter chunks only multiply those reads (an estimate).
PREFILL_CHUNK = MappingProxyType({"cpu": 32})
PREFILL_CHUNK_ACCELERATOR = 256
# Alternatives per token --logprobs may ask for (OpenAI's and vLLM's default cap).
MAX_LOGPROBS = 20


class DecodeError(ProveJaxError, ValueError):
    """A decoding request that cannot be served (bad prompt, mode, or model pairing)."""


def default_prefill_chunk() -> int:
    """Prompt tokens per prefill forward on the default backend (see PREFILL_CHUNK)."""
    return PREFILL_CHUNK.get(jax.default_backend(), PREFILL_CHUNK_ACCELERATOR)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode; frozen and hashable, since it keys the decoder's compiled programs."""

    mode: str = "ar"
    """One of MODES."""
    block_size: int = 8
    """K: tokens proposed per proposer forward (`ar` runs with 1)."""
    max_groups: int | None = None
    """lossless: mask groups, i.e. acceptance lengths served in a step; None: K."""
    adaptive: bool = False
    """lossless: shrink K and the groups as the batch grows (see adaptive.adapt_for_batch)."""
    tau: float | None = None
    """threshold: accept a proposed token while its confidence is >= tau (prob, margin) or its
    entropy <= tau nats; None: DEFAULT_TAU of the kind. A tau no token passes decodes as ar."""
    confidence: str = "prob"
    """threshold: the confidence statistic, one of CONFIDENCE_KINDS."""
    commit_rule: str = "top1"
    """verify: how the verifier accepts drafts, one of COMMIT_RULES."""
    tau_v: float = 0.5
    """verify/prob: the verifier probability a token needs to be committed."""
    head_threshold: float | None = None
    """verify/head: the head probability a token needs; None: the head's own (0.5 as trained).
    Lower commits more per forward; above 1 commits only the exact first token."""
    gate_tau: float | None = None
    """verify: also require the proposer's own confidence in each draft (the `confidence`
    statistic of its mask's distribution) to pass gate_tau, as `threshold` does with tau; None:
    the verifier decides alone."""
    relaxed_p: float | None = None
    """lossless, greedy only: also commit a draft that the proposer's own AR distribution at its
    slot gives probability >= relaxed_p (lossy: the output may leave AR's; the same forward as
    lossless, so never fewer tokens per step). None: exact lossless. Only values below 0.5 can
    add anything (a draft that is not the argmax has probability < 0.5)."""
    record_steps: bool = False
    """Keep the tokens each forward committed (BatchResult.step_commits)."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill forward; None: default_prefill_chunk()."""
    logprobs: int | None = None
    """Record each output token's log-probability and the `logprobs` most likely alternatives
    at its position (0: the token's alone); None: none."""
    kernels: KernelOptions = DEFAULT_KERNELS
    """Trace-time kernel choices (matmul form, row padding, one-pass LM head)."""
    scan_layers: bool = False
    """Run the layers of every forward as one `lax.scan` over weights stacked once when the
    Decoder is built, with a stacked KV cache: the program holds one layer's code, so compile
    time stops growing with depth (benchmarks/decode_compile.md). Unrolled: XLA may schedule
    across layers."""
    page_size: int | None = None
    """Keep the KV (the proposer's, and the verifier's on the same pages) in paged pools of
    pages of this many slots, each row owning the pages its own prompt and budget need
    (models/paged.py); None: one contiguous buffer per row, sized for the call's longest
    request. Read through the page table in XLA, or by the paged Pallas TPU kernel with
    kernels.attention="pallas_tpu"."""
    kv_pages: int | None = None
    """Pages in the pool (with page_size): a request waits until enough are free; None: as many
    as every row needs at the call's longest request (the same memory as contiguous)."""

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
            raise DecodeError(
                f"unknown confidence {self.confidence!r}; choose from {CONFIDENCE_KINDS}"
            )
        if self.tau is None:
            return dataclasses.replace(self, tau=DEFAULT_TAU[self.confidence]).validate()
        if not math.isfinite(self.tau):
            raise DecodeError(f"tau must be a finite number, got {self.tau}")
        if not (math.isfinite(self.tau_v) and self.tau_v >= 0):
            raise DecodeError(f"tau_v is a verifier probability: it must be >= 0, got {self.tau_v}")
        if self.commit_rule not in COMMIT_RULES:
            raise DecodeError(
                f"unknown commit rule {self.commit_rule!r}; choose from {COMMIT_RULES}"
            )
        if self.head_threshold is not None and not math.isfinite(self.head_threshold):
            raise DecodeError(f"head threshold must be a finite number, got {self.head_threshold}")
        if self.gate_tau is not None:
            if self.mode != "verify":
                raise DecodeError(
                    "gate_tau gates verify's commits by the proposer's confidence; mode "
                    f"{self.mode!r} has none"
                )
            if not math.isfinite(self.gate_tau):
                raise DecodeError(f"gate_tau must be a finite number, got {self.gate_tau}")
        if self.relaxed_p is not None:
            if self.mode != "lossless":
                raise DecodeError(
                    f"relaxed_p relaxes lossless acceptance; mode {self.mode!r} has none"
                )
            if not (math.isfinite(self.relaxed_p) and 0 < self.relaxed_p <= 1):
                raise DecodeError(f"relaxed_p is a probability in (0, 1], got {self.relaxed_p}")
        if self.max_groups is not None and self.max_groups < 1:
            raise DecodeError(f"max groups must be >= 1, got {self.max_groups}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise DecodeError(f"prefill chunk must be >= 1 tokens, got {self.prefill_chunk}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise DecodeError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if not isinstance(self.scan_layers, bool):
            raise DecodeError(f"scan_layers must be True or False, got {self.scan_layers!r}")
        if not isinstance(self.kernels, KernelOptions):
            raise DecodeError(f"kernels must be a KernelOptions, got {type(self.kernels).__name__}")
        if self.page_size is not None or self.kv_pages is not None:
            self._check_paged()
        return self

    def _check_paged(self) -> None:
        if self.page_size is None:
            raise DecodeError("kv_pages sizes a paged KV pool: give a page size too (--page-size)")
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise DecodeError(
                f"page size must be a whole number of slots >= 1, got {self.page_size!r}"
            )
        if self.kv_pages is not None and not (
            isinstance(self.kv_pages, int) and self.kv_pages >= 1
        ):
            raise DecodeError(
                f"kv_pages must be a whole number of pages >= 1, got {self.kv_pages!r}"
            )
        if self.kernels.attention not in ("xla", "pallas_tpu", "auto"):
            raise DecodeError(f"the paged KV pool is read by --attention xla or pallas_tpu, not "
                              f"{self.kernels.attention}")
