"""How a forward is computed, as one frozen (hashable) options object: `ComputeOptions`.

Named for what it holds, which is more than kernels: the form of the few-row projections, the
attention path (XLA or a Pallas kernel), whether the lossless step reads the LM head in one
pass, interpret mode, and the platform compiled for. None of them changes what is computed,
only how (the tokens are the same; the program and its speed are not).

Every choice here is read while tracing, so it must be part of whatever keys a compile cache:
`DecodeOptions.compute` carries it into the decoder's cache key, and model forwards take it as
an explicit argument. Nothing is read from module globals or the environment at trace time: the
one environment setting (`PROVE_JAX_CPU_MATMUL`) is read on the host when an options object is
made, into its `cpu_matmul_form` field; a bad value is a `ComputeOptionsError` when options are
made or first used, never at import (`DEFAULT_COMPUTE` holds it unchecked until used).
"""

from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType

import jax

from prove_jax.errors import ProveJaxError

MATMUL_FORMS = ("weight_major", "input_major", "plain")
ATTENTION_KERNELS = ("xla", "pallas_gpu", "pallas_tpu")  # models/attention_kernels.py
# "auto": the platform's fast path, resolved on the host (`ComputeOptions.resolve_attention`): on
# TPU the Pallas kernel, which keeps a wide step's scores in VMEM (XLA writes them to HBM per KV
# chunk: benchmarks/decode_step_cost.md); XLA elsewhere
ATTENTION_CHOICES = ATTENTION_KERNELS + ("auto",)
AUTO_ATTENTION = MappingProxyType({"tpu": "pallas_tpu"})
MATMUL_FORM_ENV = "PROVE_JAX_CPU_MATMUL"  # overrides the CPU decode form
CPU_DECODE_MAX_ROWS = 64  # past this many token rows the plain form is as fast
# A lossless step needs the LM head at 2M+1 of its T slots, known only after the first argmax:
# two passes read the head weights twice, one pass over all T slots computes the extra rows.
# Most extra rows (batch x (T - 2M - 1)) one pass takes, per platform (resolved on the host):
# on CPU the extra rows cost more than a second read of a small head past 8
# (benchmarks/step_cost.md); on TPU a step of 16 rows is bound by HBM bytes and one pass is
# cheaper, while at 64 rows it is about even (bound by FLOPs on v5e and v5p, where the extra
# rows cost more than the head's second read; by bytes on v6e): 80, K=6 G=2 at 16 rows
# (benchmarks/decode_step_cost.md); a GPU's FLOPs per byte lie between v5p's and v6e's
HEAD_ONE_PASS_MAX_EXTRA_ROWS = MappingProxyType({"cpu": 8, "tpu": 80, "gpu": 80})
# A stacked KV cache of heads under LANES wide (a 0.5B's 64), held [B, K, L * S, Dh], is laid
# out by libtpu for the step's scatter by its bytes a chip (one of K, V; v5e and v6e alike):
# head dim minor up to 120 MiB, slots minor from 133 MiB; a kernel reading the other layout
# copied it whole per layer per step. On TPU such a cache is shaped slots minor, [B, K, Dh,
# L * S], from KV_SLOTS_MINOR_MIN_BYTES a chip, as the scatter lays it out; CPU and GPU keep
# [.., L * S, Dh] (benchmarks/decode_step_cost.md)
LANES = 128
KV_SLOTS_MINOR_MIN_BYTES = 128 * 2 ** 20


class ComputeOptionsError(ProveJaxError, ValueError):
    """A compute choice no program has: an unknown form or kernel, or a bad
    PROVE_JAX_CPU_MATMUL."""


def _env_cpu_form() -> str:
    """`PROVE_JAX_CPU_MATMUL` as set (unchecked), else weight-major, which holds up at real model
    sizes on every CPU measured; input-major copies every weight per call (step_cost.md)."""
    return os.environ.get(MATMUL_FORM_ENV) or "weight_major"


def _checked_cpu_form(form: str) -> str:
    if form not in MATMUL_FORMS:
        raise ComputeOptionsError(f"{MATMUL_FORM_ENV}={form!r}: "
                                 f"choose one of {', '.join(MATMUL_FORMS)}")
    return form


def default_cpu_form() -> str:
    """The CPU's default decode form: `PROVE_JAX_CPU_MATMUL` if set, else weight-major; a bad
    value is a ComputeOptionsError."""
    return _checked_cpu_form(_env_cpu_form())


@dataclasses.dataclass(frozen=True)
class ComputeOptions:
    """How the model's projections and the lossless step's LM head are computed."""

    matmul_form: str | None = None
    """Form of a decode step's few-row projections (one of MATMUL_FORMS); None: the platform's
    default (CPU: `cpu_matmul_form`; accelerators: plain)."""
    matmul_max_rows: int | None = None
    """Most token rows the decode form is used for; None: CPU_DECODE_MAX_ROWS."""
    pad_dot_rows: bool = True
    """Pad weight-major products to whole CPU kernel tiles (see benchmarks/step_cost.md)."""
    lm_head_one_pass: bool = True
    """Allow the lossless step to read the LM head once over every slot when few rows are extra."""
    head_one_pass_max_extra_rows: int | None = None
    """Most extra rows (batch x slots whose logits the step does not need) one LM-head pass may
    compute; past them two passes; None: the platform's (HEAD_ONE_PASS_MAX_EXTRA_ROWS, spelled
    out by `resolve`)."""
    kv_slots_minor: bool | None = None
    """Hold a stacked KV cache whose head dim is under LANES slots minor, [B, K, Dh, L * S]
    (`attention.KVCache`): True or False forces it; None: the platform's rule, spelled out by
    `resolve`: never on CPU and GPU; on TPU where the cache is made, from KV_SLOTS_MINOR_MIN_BYTES
    of one buffer a chip (`kv_held_slots_minor`)."""
    pool_narrow_kv: bool | None = None
    """Keep the KV of a verifier whose head dim is under LANES in the proposer's paged pool
    (`paged.pooled`): True or False forces it; None: the platform's rule, spelled out by
    `resolve`: pooled on CPU and GPU, not on TPU (`pools_kv`)."""
    attention: str = "xla"
    """How cached attention reads the committed slots: "xla" (chunked, models/attention.py) or a
    shipped kernel (models/attention_kernels.py ATTENTION_KERNELS, e.g. "pallas_gpu"); "auto"
    until resolved on the host (`resolve_attention`, `resolve`): a program never traces it."""
    interpret: bool = False
    """Run a Pallas attention kernel in interpret mode (any backend; slow: for tests)."""
    platform: str | None = None
    """The platform the program is compiled for ("cpu", "gpu", "tpu"): it picks the default matmul
    form and the cache's chunk size, and is checked against the attention kernel; None: jax's
    default backend. Set it for an AOT compile for another one (`resolve`)."""
    cpu_matmul_form: str = dataclasses.field(default_factory=default_cpu_form)
    """The CPU's form where `matmul_form` is None: PROVE_JAX_CPU_MATMUL as it was when these
    options were made (read there, on the host, so that it keys a compile cache), else
    weight_major."""

    def __post_init__(self):
        # cpu_matmul_form is checked where it is used (`decode_form`), so that DEFAULT_COMPUTE,
        # made at import, can hold a bad PROVE_JAX_CPU_MATMUL without failing the import
        if self.matmul_form is not None and self.matmul_form not in MATMUL_FORMS:
            raise ComputeOptionsError(f"unknown matmul form {self.matmul_form!r}; "
                                     f"choose one of {', '.join(MATMUL_FORMS)}")
        if self.head_one_pass_max_extra_rows is not None and self.head_one_pass_max_extra_rows < 0:
            raise ComputeOptionsError("head_one_pass_max_extra_rows must be >= 0, got "
                                      f"{self.head_one_pass_max_extra_rows}")
        if self.attention not in ATTENTION_CHOICES:
            raise ComputeOptionsError(f"unknown attention kernel {self.attention!r}; "
                                     f"choose one of {', '.join(ATTENTION_CHOICES)}")

    def target(self) -> str:
        """The platform compiled for: `platform`, else jax's default backend (one per process).
        The fallback is for a forward called directly (a test, a notebook): every jitted entry
        point (the Decoder's programs, the train step, held-out evaluation, calibration's
        timings, the commit-head step) traces with options `resolve`d on the host, so that its
        trace reads fields only (tests/test_trace_time.py)."""
        return self.platform or jax.default_backend()

    def decode_form(self) -> tuple[str, int]:
        """(form, most token rows it is used for) of a decode step's projections: `matmul_form`,
        else the target platform's default (CPU: `cpu_matmul_form`; accelerators: plain)."""
        max_rows = CPU_DECODE_MAX_ROWS if self.matmul_max_rows is None else self.matmul_max_rows
        if self.matmul_form is not None:
            return self.matmul_form, max_rows
        if self.target() == "cpu":
            return _checked_cpu_form(self.cpu_matmul_form), max_rows
        return "plain", 0

    def head_extra_rows(self) -> int:
        """Most extra rows one lossless LM-head pass may compute: `head_one_pass_max_extra_rows`,
        else the target platform's (HEAD_ONE_PASS_MAX_EXTRA_ROWS; the CPU's elsewhere)."""
        if self.head_one_pass_max_extra_rows is not None:
            return self.head_one_pass_max_extra_rows
        return HEAD_ONE_PASS_MAX_EXTRA_ROWS.get(self.target(), HEAD_ONE_PASS_MAX_EXTRA_ROWS["cpu"])

    def kv_held_slots_minor(self, head_dim: int, chip_bytes: int) -> bool:
        """Whether a stacked KV buffer of heads `head_dim` wide, `chip_bytes` (one of K, V) on
        a chip, is held slots minor: never at LANES and over; else `kv_slots_minor` if set, else
        on TPU from KV_SLOTS_MINOR_MIN_BYTES (the layout libtpu's scatter picks there)."""
        if head_dim >= LANES:
            return False
        if self.kv_slots_minor is not None:
            return self.kv_slots_minor
        return self.target() == "tpu" and chip_bytes >= KV_SLOTS_MINOR_MIN_BYTES

    def pools_kv(self, head_dim: int) -> bool:
        """Whether a verifier's KV of heads `head_dim` wide may sit in the proposer's paged
        pool: always at LANES and over; else `pool_narrow_kv` if set, else off TPU only. On TPU
        libtpu lays the pool's scatter out slots minor while the paged kernel reads it head dim
        minor, and copied the whole pool per layer per step (benchmarks/decode_step_cost.md);
        such a verifier keeps a contiguous cache beside the pool."""
        if head_dim >= LANES:
            return True
        if self.pool_narrow_kv is not None:
            return self.pool_narrow_kv
        return self.target() != "tpu"

    def resolve(self, platform: str | None = None) -> "ComputeOptions":
        """These options with every default spelled out on the host: the platform (`platform`,
        else this one's, else jax's backend), the matmul form it takes (`decode_form`), its
        LM-head rule (`head_extra_rows`), KV layout rule (`kv_slots_minor`: False off TPU;
        on TPU None, the cache's size decides) and pool rule (`pool_narrow_kv`: off TPU only),
        as an AOT compile for another platform needs them (`decoding/dry_run.slice_options`)."""
        resolved = dataclasses.replace(self, platform=platform or self.target())
        resolved = resolved.resolve_attention(resolved.platform)
        form, max_rows = resolved.decode_form()
        off_tpu = resolved.platform != "tpu"
        slots_minor = False if self.kv_slots_minor is None and off_tpu else self.kv_slots_minor
        pooled = off_tpu if self.pool_narrow_kv is None else self.pool_narrow_kv
        return dataclasses.replace(resolved, matmul_form=form, matmul_max_rows=max_rows,
                                   head_one_pass_max_extra_rows=resolved.head_extra_rows(),
                                   kv_slots_minor=slots_minor,
                                   pool_narrow_kv=pooled)

    def resolve_attention(self, platform: str | None = None) -> "ComputeOptions":
        """These options with attention "auto" replaced, on the host, by the fast path of
        `platform` (else the target's): AUTO_ATTENTION, else "xla"."""
        if self.attention != "auto":
            return self
        attention = AUTO_ATTENTION.get(platform or self.target(), "xla")
        return dataclasses.replace(self, attention=attention)


# made at import: the environment's form unchecked, a bad one raising where it is first used
DEFAULT_COMPUTE = ComputeOptions(cpu_matmul_form=_env_cpu_form())
