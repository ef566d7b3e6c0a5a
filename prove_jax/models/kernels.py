"""Kernel choices that change a compiled program, as one frozen (hashable) options object.

Every choice here is read while tracing, so it must be part of whatever keys a compile cache:
`DecodeOptions.kernels` carries it into the decoder's cache key, and model forwards take it as
an explicit argument. Nothing is read from module globals at trace time.
"""

from __future__ import annotations

import dataclasses

MATMUL_FORMS = ("weight_major", "input_major", "plain")
ATTENTION_KERNELS = ("xla", "pallas_gpu", "pallas_tpu")  # models/attention_kernels.py


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
    attention: str = "xla"
    """How cached attention reads the committed slots: "xla" (chunked, models/attention.py) or a
    shipped kernel (models/attention_kernels.py ATTENTION_KERNELS, e.g. "pallas_gpu")."""
    interpret: bool = False
    """Run a Pallas attention kernel in interpret mode (any backend; slow: for tests)."""
    platform: str | None = None
    """The platform the program is compiled for ("cpu", "gpu", "tpu"), checked against the
    attention kernel; None: jax's default backend. Set it for an AOT compile for another one."""

    def __post_init__(self):
        if self.matmul_form is not None and self.matmul_form not in MATMUL_FORMS:
            raise ValueError(f"unknown matmul form {self.matmul_form!r}; choose one of {', '.join(MATMUL_FORMS)}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention kernel {self.attention!r}; "
                             f"choose one of {', '.join(ATTENTION_KERNELS)}")


DEFAULT_KERNELS = KernelOptions()
