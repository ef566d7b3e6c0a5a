"""What a decode call may ask for: `DecodeOptions`, its allowed values and defaults.

`DecodeOptions` keeps at top level what every mode reads (mode, K, what is recorded, how it is
computed) and groups the rest by who reads it, so that each mode's knobs are visible together
and a mode's code reads one object: `lossless` (LosslessRule), `threshold` (ThresholdRule),
`verify` (VerifyRule), and `memory` (MemoryLayout: where the weights and KV live and how much of
the prompt a forward holds, choices that change memory and compile time but never a token).
Each group checks its own fields; DecodeOptions checks what spans groups (a mode's rule given
to another mode, the paged pool's attention path). All are frozen and hashable: together they
key the decoder's compiled programs.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import jax

from prove_jax.errors import ProveJaxError
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions

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


def default_prefill_chunk(platform: str | None = None) -> int:
    """Prompt tokens per prefill forward on `platform` (None: the default backend; see
    PREFILL_CHUNK)."""
    return PREFILL_CHUNK.get(platform or jax.default_backend(), PREFILL_CHUNK_ACCELERATOR)


@dataclasses.dataclass(frozen=True)
class LosslessRule:
    """How `lossless` serves and accepts drafts: the mask groups one step feeds, whether they
    adapt to the batch, and the optional lossy relaxation of its exact acceptance."""

    max_groups: int | None = None
    """Mask groups, i.e. acceptance lengths served in a step; None: K."""
    adaptive: bool = False
    """Shrink K and the groups as the batch grows (see adaptive.adapt_for_batch)."""
    relaxed_p: float | None = None
    """Greedy only: also commit a draft that the proposer's own AR distribution at its slot gives
    probability >= relaxed_p (lossy: the output may leave AR's; the same forward as lossless,
    so never fewer tokens per step). None: exact lossless. Only values below 0.5 can add
    anything (a draft that is not the argmax has probability < 0.5)."""

    def validate(self, mode: str) -> "LosslessRule":
        if self.relaxed_p is not None:
            if mode != "lossless":
                raise DecodeError(f"relaxed_p relaxes lossless acceptance; mode {mode!r} has none")
            if not (math.isfinite(self.relaxed_p) and 0 < self.relaxed_p <= 1):
                raise DecodeError(f"relaxed_p is a probability in (0, 1], got {self.relaxed_p}")
        if self.max_groups is not None and self.max_groups < 1:
            raise DecodeError(f"max groups must be >= 1, got {self.max_groups}")
        return self


@dataclasses.dataclass(frozen=True)
class ThresholdRule:
    """How `threshold` accepts the proposer's own drafts: a confidence statistic and its bar.
    verify's optional gate (`VerifyRule.gate_tau`) reads the same statistic."""

    tau: float | None = None
    """Accept a proposed token while its confidence is >= tau (prob, margin) or its entropy <=
    tau nats; None: DEFAULT_TAU of the kind. A tau no token passes decodes as ar."""
    confidence: str = "prob"
    """The confidence statistic, one of CONFIDENCE_KINDS."""

    def validate(self) -> "ThresholdRule":
        """Checked copy, with tau's default for the statistic filled in."""
        if self.confidence not in CONFIDENCE_KINDS:
            raise DecodeError(
                f"unknown confidence {self.confidence!r}; choose from {CONFIDENCE_KINDS}"
            )
        if self.tau is None:
            return dataclasses.replace(self, tau=DEFAULT_TAU[self.confidence]).validate()
        if not math.isfinite(self.tau):
            raise DecodeError(f"tau must be a finite number, got {self.tau}")
        return self


@dataclasses.dataclass(frozen=True)
class VerifyRule:
    """How `verify`'s verifier commits the proposer's drafts."""

    commit_rule: str = "top1"
    """How the verifier accepts drafts, one of COMMIT_RULES."""
    tau_v: float = 0.5
    """prob: the verifier probability a token needs to be committed."""
    head_threshold: float | None = None
    """head: the head probability a token needs; None: the head's own (0.5 as trained). Lower
    commits more per forward; above 1 commits only the exact first token."""
    gate_tau: float | None = None
    """Also require the proposer's own confidence in each draft (`ThresholdRule.confidence`'s
    statistic of its mask's distribution) to pass gate_tau, as `threshold` does with tau;
    None: the verifier decides alone."""

    def validate(self, mode: str) -> "VerifyRule":
        if not (math.isfinite(self.tau_v) and self.tau_v >= 0):
            raise DecodeError(f"tau_v is a verifier probability: it must be >= 0, got {self.tau_v}")
        if self.commit_rule not in COMMIT_RULES:
            raise DecodeError(
                f"unknown commit rule {self.commit_rule!r}; choose from {COMMIT_RULES}"
            )
        if self.head_threshold is not None and not math.isfinite(self.head_threshold):
            raise DecodeError(f"head threshold must be a finite number, got {self.head_threshold}")
        if self.gate_tau is not None:
            if mode != "verify":
                raise DecodeError(
                    "gate_tau gates verify's commits by the proposer's confidence; mode "
                    f"{mode!r} has none"
                )
            if not math.isfinite(self.gate_tau):
                raise DecodeError(f"gate_tau must be a finite number, got {self.gate_tau}")
        return self


@dataclasses.dataclass(frozen=True)
class MemoryLayout:
    """Where the weights and the KV live and how much of a prompt one forward holds: every mode's,
    and none of them changes a token (only memory, step time and compile time)."""

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
    compute.attention="pallas_tpu"."""
    kv_pages: int | None = None
    """Pages in the pool (with page_size): a request waits until enough are free; None: as many
    as every row needs at the call's longest request (the same memory as contiguous)."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill forward; None: default_prefill_chunk()."""

    def validate(self, attention: str) -> "MemoryLayout":
        """Checked; `attention` is the compute options' path, which must read a paged pool."""
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise DecodeError(f"prefill chunk must be >= 1 tokens, got {self.prefill_chunk}")
        if not isinstance(self.scan_layers, bool):
            raise DecodeError(f"scan_layers must be True or False, got {self.scan_layers!r}")
        if self.page_size is not None or self.kv_pages is not None:
            self._check_paged(attention)
        return self

    def _check_paged(self, attention: str) -> None:
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
        if attention not in ("xla", "pallas_tpu", "auto"):
            raise DecodeError(f"the paged KV pool is read by --attention xla or pallas_tpu, not "
                              f"{attention}")


_GROUPS = MappingProxyType({"lossless": LosslessRule, "threshold": ThresholdRule,
                            "verify": VerifyRule, "memory": MemoryLayout})


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode; frozen and hashable, since it keys the decoder's compiled programs."""

    mode: str = "ar"
    """One of MODES."""
    block_size: int = 8
    """K: tokens proposed per proposer forward (`ar` runs with 1)."""
    lossless: LosslessRule = LosslessRule()
    """lossless: its groups, adaptivity and relaxed acceptance."""
    threshold: ThresholdRule = ThresholdRule()
    """threshold: its confidence statistic and bar (verify's gate reads the statistic)."""
    verify: VerifyRule = VerifyRule()
    """verify: how the verifier commits."""
    memory: MemoryLayout = MemoryLayout()
    """Every mode's: layer scan, paged KV pool, prefill chunk."""
    record_steps: bool = False
    """Keep the tokens each forward committed (BatchResult.step_commits)."""
    logprobs: int | None = None
    """Record each output token's log-probability and the `logprobs` most likely alternatives
    at its position (0: the token's alone); None: none."""
    compute: ComputeOptions = DEFAULT_COMPUTE
    """How the forwards are computed (matmul form, attention path, one-pass LM head, platform:
    models/compute.py)."""

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
        for name, group in _GROUPS.items():
            if not isinstance(getattr(self, name), group):
                raise DecodeError(f"{name} must be a {group.__name__}, "
                                  f"got {type(getattr(self, name)).__name__}")
        if not isinstance(self.compute, ComputeOptions):
            raise DecodeError(
                f"compute must be a ComputeOptions, got {type(self.compute).__name__}")
        groups = dict(threshold=self.threshold.validate(), verify=self.verify.validate(self.mode),
                      lossless=self.lossless.validate(self.mode),
                      memory=self.memory.validate(self.compute.attention))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise DecodeError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(getattr(self, name) is not group for name, group in groups.items()):
            return dataclasses.replace(self, **groups)
        return self
