"""Adaptive lossless: the (K, groups) layout to run at each batch size (calibrate.py measures
tables for this device; ADAPTIVE_TABLES are the fixed defaults)."""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Sequence

import jax

from prove_jax.decoding.options import DecodeError, DecodeOptions

# Rows (max batch, K, groups); past the last row, plain AR. On accelerators a narrow step costs
# about one token (weight reads), so wide layouts pay at small batches and narrow as the batch
# grows (benchmarks/h200/decode_adaptive.md). On CPU whether lossless pays depends on the
# machine and the proposer, which no fixed table knows: AR, and `--calibrate` measures
# (benchmarks/step_cost.md, benchmarks/decode.md).
# Read-only: a table is chosen per Decoder (`adaptive_table=`), never by editing this one.
ADAPTIVE_TABLES: Mapping[str, tuple[tuple[int, int, int], ...]] = types.MappingProxyType({
    "gpu": ((1, 8, 8), (4, 6, 4), (8, 4, 3), (16, 4, 2), (32, 2, 2)),
    "tpu": ((1, 8, 8), (4, 6, 4), (8, 4, 3), (16, 4, 2), (32, 2, 2)),
    "cpu": (),
})


def adapt_for_batch(options: DecodeOptions, batch: int, platform: str | None = None,
                    table: Sequence[tuple[int, int, int]] | None = None) -> DecodeOptions:
    """The lossless (K, groups) to run at this batch size: from `table` (e.g. measured by
    `calibrate.calibrate`) or this platform's ADAPTIVE_TABLES row; a row with K=1 is plain AR."""
    if options.mode != "lossless" or not options.lossless.adaptive:
        return options
    if table is None:
        table = ADAPTIVE_TABLES.get(platform or jax.devices()[0].platform, ADAPTIVE_TABLES["gpu"])
    for max_batch, block_size, groups in table:
        if batch <= max_batch:
            block_size = min(block_size, options.block_size)
            if block_size < 2:
                break
            groups = min(groups, options.lossless.max_groups or groups)
            lossless = dataclasses.replace(options.lossless, max_groups=groups)
            return dataclasses.replace(options, block_size=block_size, lossless=lossless)
    return dataclasses.replace(options, mode="ar", block_size=1)


def check_adaptive_table(table) -> tuple[tuple[int, int, int], ...]:
    """A validated copy of an adaptive table: rows (max_batch, K, groups), batch increasing."""
    rows = tuple(tuple(int(x) for x in row) for row in table)
    for i, row in enumerate(rows):
        if len(row) != 3 or row[0] < 1 or row[1] < 1 or row[2] < 1:
            raise DecodeError(
                f"adaptive table row {i} must be (max_batch >= 1, K >= 1, groups >= 1), got {row}"
            )
        if i and row[0] <= rows[i - 1][0]:
            raise DecodeError(f"adaptive table rows must have increasing max_batch, got {rows}")
    return rows
