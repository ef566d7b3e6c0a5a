"""Config values checked against their dataclass field's annotation.

Both config kinds (the model's config.json, `models.config.ModelConfig`, and the training YAML,
`training.config.TrainConfig`) hold values typed by whoever wrote them, so one rule serves both:
a bool is never a number; an integral float passes for an int (`1e3` steps) and an int for a
float; `tuple[int, ...]` takes a list of ints. Annotations are the strings `from __future__
import annotations` leaves (`'int | None'`).
"""

from __future__ import annotations

from typing import Any

_SCALARS = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "list": list}
_INT_TUPLE = "tuple[int, ...]"


class AnnotationMismatch(TypeError):
    """A value that its field's annotation does not admit; `wanted` says what would do."""

    def __init__(self, wanted: str):
        super().__init__(wanted)
        self.wanted = wanted


def options(annotation: str) -> list[str]:
    """'int | None' -> ['int', 'None']."""
    return [part.strip() for part in annotation.split("|")]


def wanted(annotation: str) -> str:
    """How an error names the annotation: 'float or null', 'a list of ints'."""
    names = {"None": "null", _INT_TUPLE: "a list of ints"}
    return " or ".join(names.get(o, o) for o in options(annotation))


def _conform_one(value: Any, option: str) -> tuple[bool, Any]:
    if option == "None":
        return value is None, None
    if isinstance(value, bool):
        return option == "bool", value
    if option == "int" and isinstance(value, float) and value.is_integer():
        return True, int(value)
    if option == "float" and isinstance(value, int):
        return True, float(value)
    if option == _INT_TUPLE:
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
        return ok, tuple(value) if ok else None
    kind = _SCALARS.get(option)
    if kind is None:
        raise ValueError(f"annotation {option!r} is not one a config field may use")
    return isinstance(value, kind), value


def conform(value: Any, annotation: str) -> Any:
    """`value` as a field annotated `annotation` holds it (`2.0` -> 2 for an int, a list -> a
    tuple for `tuple[int, ...]`), or AnnotationMismatch."""
    for option in options(annotation):
        ok, converted = _conform_one(value, option)
        if ok:
            return converted
    raise AnnotationMismatch(wanted(annotation))
