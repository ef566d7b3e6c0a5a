"""Kernel choices that change a compiled program, as one frozen (hashable) options object.

Every choice here is read while tracing, so it must be part of whatever keys a compile cache:
`DecodeOptions.kernels` carries it into the decoder's cache key, and model forwards take it as
an explicit argument. Nothing is read from module globals at trace time.
"""

from __future__ import annotations

import dataclasses

MATMUL_FORMS = ("weight_major", "input_major", "plain")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the model's projections and the lossless step's LM head are computed."""

    matmul_form: str | None = None
    """Form of a decode step's few-row projections (one of MATMUL_FORMS); None: the backend's
    default (CPU: weight_major, or PROVE_JAX_CPU_MATMUL; accelerators: plain)."""
    matmul_max_rows: int | None = None
    """Most token rows the decode form is used for; None: the backend's default."""
    pad_dot_rows: bool = True
    """Pad weight-major products to whole CPU kernel tiles (see benchmarks/step_cost.md)."""
    lm_head_one_pass: bool = True
    """Allow the lossless step to read the LM head once over every slot when few rows are extra."""

    def __post_init__(self):
        if self.matmul_form is not None and self.matmul_form not in MATMUL_FORMS:
            raise ValueError(f"unknown matmul form {self.matmul_form!r}; choose one of {', '.join(MATMUL_FORMS)}")


DEFAULT_KERNELS = KernelOptions()
