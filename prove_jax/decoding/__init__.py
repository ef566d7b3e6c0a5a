"""ProVe / MARS decoding: AR, threshold, lossless and verifier modes in one compiled loop."""

from prove_jax.decoding.engine import (COMMIT_RULES, CONFIDENCE_KINDS, DEFAULT_TAU, MODES, BatchResult,
                                       DecodeError, DecodeOptions, Decoder, adapt_for_batch)

__all__ = ["COMMIT_RULES", "CONFIDENCE_KINDS", "DEFAULT_TAU", "MODES", "BatchResult", "DecodeError",
           "DecodeOptions", "Decoder", "adapt_for_batch"]
