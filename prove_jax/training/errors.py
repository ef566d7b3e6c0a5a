"""The error of a training run that cannot start or continue (a bad setting is a
`TrainConfigError`)."""

from __future__ import annotations

from prove_jax.errors import ProveJaxError


class TrainError(ProveJaxError, RuntimeError):
    """A run that cannot start or continue, with a message naming the cause."""
