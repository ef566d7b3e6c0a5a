"""checkpoints/restore_errors.py: the reason shown for a failed restore is the error's first
line, without tensorstore's spec dump."""

from __future__ import annotations

from prove_jax.checkpoints import restore_errors


def test_restore_error_reason_is_the_first_line_without_the_spec_dump():
    e = ValueError("NOT_FOUND: Error opening file x [tensorstore_spec={...}]\nTraceback junk\nmore")
    assert restore_errors.restore_error_reason(e) == "NOT_FOUND: Error opening file x"
