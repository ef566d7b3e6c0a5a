"""ProVe / MARS decoding: AR, threshold, lossless and verifier modes in one compiled loop."""

from prove_jax.decoding.adaptive import ADAPTIVE_TABLES, adapt_for_batch, check_adaptive_table
from prove_jax.decoding.engine import BatchResult, Decoder
from prove_jax.decoding.options import (
    COMMIT_RULES,
    CONFIDENCE_KINDS,
    DEFAULT_TAU,
    MAX_STEP_WIDTH,
    MODES,
    DecodeError,
    DecodeOptions,
    LosslessRule,
    MemoryLayout,
    ThresholdRule,
    VerifyRule,
    default_prefill_chunk,
)
from prove_jax.decoding.sampling import SamplingParams
from prove_jax.models.compute import ComputeOptions

__all__ = [
    "ADAPTIVE_TABLES",
    "COMMIT_RULES",
    "CONFIDENCE_KINDS",
    "DEFAULT_TAU",
    "MAX_STEP_WIDTH",
    "MODES",
    "BatchResult",
    "DecodeError",
    "DecodeOptions",
    "ComputeOptions",
    "Decoder",
    "LosslessRule",
    "MemoryLayout",
    "ThresholdRule",
    "VerifyRule",
    "SamplingParams",
    "adapt_for_batch",
    "check_adaptive_table",
    "default_prefill_chunk",
]
