"""Argument types of `prove-jax benchmark` and the scripts in benchmarks/: comma lists and
lossless layouts, each bad value a BenchError that argparse reports as its own message."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from prove_jax.evaluation.sweep import BenchError


def positive_ints(text: str, what: str = "value") -> list[int]:
    """'1,4,16' -> [1, 4, 16]: comma-separated integers >= 1, else a BenchError naming `what`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{what} must be positive integers, got {text!r}")
    return values


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse `type=` from a parser that raises BenchError, so argparse reports its message."""
    def convert(text: str):
        try:
            return parse(text)
        except BenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def parse_layouts(text: str, flag: str = "--layouts") -> tuple[tuple[int, int | None], ...]:
    """'6x2,4x2,3' -> ((6, 2), (4, 2), (3, None)): lossless layouts as K x G (mask groups), or K
    alone for all K groups; a BenchError naming `flag` otherwise."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        k, _, g = item.lower().partition("x")
        try:
            k_i, g_i = int(k), (int(g) if g else None)
        except ValueError:
            raise BenchError(f"{flag}: {item!r} is not a layout; write K x G as 6x2 (K tokens "
                             f"proposed, G mask groups), or K alone, e.g. {flag} 6x2,4x2") from None
        if k_i < 2 or (g_i is not None and g_i < 1):
            raise BenchError(f"{flag}: {item!r}: K must be >= 2 and G >= 1")
        out.append((k_i, g_i))
    return tuple(out)


def parse_choices(text: str, choices: Sequence[str], flag: str) -> list[str]:
    """'ar,lossless' -> ['ar', 'lossless'], each one of `choices`; a BenchError naming `flag`."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in choices]
    if unknown:
        raise BenchError(f"{flag}: unknown {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(choices)}")
    return items
