"""Fixtures the decoding tests share."""

import pytest

from prove_jax.models.params import create_model
from tests.decode_helpers import CFG


@pytest.fixture(scope="module")
def model():
    """The small random model of `decode_helpers.CFG`."""
    return create_model(CFG, seed=3)
