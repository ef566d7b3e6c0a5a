"""What one execution of a compiled program moves through device memory, read from its HLO text.

XLA's `cost_analysis()` counts a while loop's body once, whatever its trip count, so for a
decode step (a 64-layer scan inside the step loop, a chunked KV read inside each layer) it
reports a small fraction of the traffic. This walks the compiled module instead: each
top-level instruction of a computation reads its operands and writes its result once (a
fusion is one kernel: what its fused computation slices out of an operand is what it reads; a
dynamic-update-slice or scatter into a parameter is written in place, only the update moves);
a while loop costs its body (and condition) times its trip count, which the compiler states
as `known_trip_count` (a scan) or the caller supplies (a loop bounded by traced values, such
as the chunked read of a cache up to its longest row). Buffers in a faster memory space
(`S(1)`: TPU VMEM) are not HBM traffic. FLOPs are those of the dots, with the same trip
counts (elementwise work is small beside them in a decode step). A Pallas kernel (a custom
call) that states its own cost (`pl.CostEstimate`, carried in its backend config) costs what it
states: the blocks it fetches, not its whole operands (a paged kernel's operand is every page
of every layer); one that states none costs its operands and results.

It is an estimate of the compiled program's traffic, not a simulation: it assumes every
top-level operand is read from HBM once, which is what a memory-bound step does
(tests/decoding/test_step_cost.py checks it against a hand count).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
# one array shape with its optional layout: bf16[4,64]{1,0:T(8,128)(2,1)S(1)}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# opcodes that move nothing: views, bookkeeping, values known at compile time
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "add-dependency",
    "domain",
    "iota",
}
_ASYNC_DONE = re.compile(r"-done$")
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # result type text (an array or a tuple)
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    shapes: dict  # value name -> result type text (parameters included)

    @property
    def root(self) -> Instr:
        return next((i for i in self.instrs if i.root), self.instrs[-1])

    def instr(self, name: str) -> Instr | None:
        return next((i for i in self.instrs if i.name == name), None)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets of any kind."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return out


def _type_and_rest(text: str) -> tuple[str, str]:
    """'(f32[2], s32[]) while(%x), ...' -> ('(f32[2], s32[])', 'while(%x), ...')."""
    text = text.strip()
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[: i + 1], text[i + 1:].strip()
    m = re.match(r"[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?", text)
    if m is None:  # a token or an opaque type
        first, _, rest = text.partition(" ")
        return first, rest
    return m.group(0), text[m.end():].strip()


def parse_module(hlo_text: str) -> tuple[dict[str, Computation], str]:
    """({computation name: Computation}, entry name) of compiled HLO module text."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m is None:
                continue
            current = Computation(m.group(2), [], {})
            if m.group(1):
                entry = current.name
            for param in _split_top(m.group(3)):
                pname, _, ptype = param.partition(":")
                if ptype:
                    current.shapes[pname.strip().lstrip("%")] = ptype.strip()
            continue
        if line.startswith("}"):
            comps[current.name] = current
            current = None
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        shape, rest = _type_and_rest(m.group(3))
        om = re.match(r"([\w\-]+)\((.*)$", rest)
        if om is None:
            continue
        opcode, tail = om.group(1), om.group(2)
        depth, end = 1, len(tail)
        for i, ch in enumerate(tail):
            depth += ch in "([{"
            depth -= ch in ")]}"
            if depth == 0:
                end = i
                break
        operands = [
            o.strip().split(" ")[-1].lstrip("%") for o in _split_top(tail[:end]) if o.strip()
        ]
        instr = Instr(m.group(2), shape, opcode, operands, tail[end + 1:], root=bool(m.group(1)))
        current.instrs.append(instr)
        current.shapes[instr.name] = shape
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def array_bytes(type_text: str, hbm_only: bool = True) -> int:
    """Bytes of every array in a result type (a tuple: all elements); with `hbm_only`, arrays
    laid out in another memory space (`S(n)`, n > 0: TPU VMEM and the like) count nothing."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        if hbm_only and layout and re.search(r"S\([1-9]", layout):
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return int(total)


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    return [x.strip().lstrip("%") for x in m.group(1).split(",")] if m else []


def trip_count(instr: Instr, comps: dict | None = None) -> int | None:
    """The trip count of a compiled while loop: the one it states (`known_trip_count`, as
    XLA:CPU prints it), or that of a counted loop (a scan: its condition is `counter < N` for
    a constant N, the counter starting at 0, as libtpu's compile leaves it); None for a loop
    bounded by traced values."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    if m:
        return int(m.group(1))
    cond = (comps or {}).get(_attr(instr.attrs, "condition") or "")
    if cond is None:
        return None
    root = cond.root
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter, bound = (cond.instr(o) for o in root.operands)
    if (
        counter is None
        or bound is None
        or counter.opcode != "get-tuple-element"
        or bound.opcode != "constant"
    ):
        return None
    value = re.match(r"\s*(-?\d+)", bound.operands[0] if bound.operands else "")
    return int(value.group(1)) if value else None


# a Pallas TPU kernel's pl.CostEstimate, as libtpu's compiled HLO carries it in the custom
# call's backend config: "cost_estimate":{"flops":"123",...,"bytes_accessed":"4567",...}
_KERNEL_ESTIMATE = re.compile(
    r'"cost_estimate":\{[^}]*?"flops":"?(\d+)"?[^}]*?"bytes_accessed":"?(\d+)"?'
)


def kernel_estimate(attrs: str) -> tuple[int, int] | None:
    """(HBM bytes, FLOPs) a custom call's kernel states for itself (a Pallas call's
    `cost_estimate`: what its blocks fetch, not its whole operands), None if it states none."""
    m = _KERNEL_ESTIMATE.search(attrs)
    return None if m is None else (int(m.group(2)), int(m.group(1)))


def _dot_flops(instr: Instr, shapes: dict) -> int:
    """2 x result elements x contracted size of a dot, or of a convolution (libtpu writes a
    matmul as one: `dim_labels=bf_oi->bf`, the lhs's `f` contracted)."""
    out = math.prod(_dims(instr.shape))
    lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
    if instr.opcode == "convolution":
        m = re.search(r"dim_labels=([0-9a-z]+)_", instr.attrs)
        contract = lhs[m.group(1).index("f")] if m and lhs and "f" in m.group(1) else 1
        return 2 * out * contract
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
    contract = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
    return 2 * out * contract


@dataclasses.dataclass
class Cost:
    """HBM bytes and dot FLOPs of one execution, and where the bytes went (by opcode, and the
    largest single instructions, loop trips included)."""
    bytes: int = 0
    flops: int = 0
    by_opcode: dict = dataclasses.field(default_factory=dict)
    # (bytes, computation, instruction, opcode, shape)
    top: list = dataclasses.field(default_factory=list)
    unknown_loops: int = 0
    """While loops without a stated trip count, priced at the caller's count."""

    def add(self, other: "Cost", times: int = 1) -> None:
        self.bytes += other.bytes * times
        self.flops += other.flops * times
        for k, v in other.by_opcode.items():
            self.by_opcode[k] = self.by_opcode.get(k, 0) + v * times
        self.top += [(b * times, *rest) for b, *rest in other.top]
        self.unknown_loops += other.unknown_loops

    def largest(self, n: int = 10) -> list:
        return sorted(self.top, key=lambda t: -t[0])[:n]


class ModuleCost:
    """Costs of the computations of one compiled module (memoised per computation)."""

    def __init__(self, hlo_text: str, unknown_trips: Callable[[Instr, int], int] | int = 1):
        """`unknown_trips`: the trip count of a while loop that states none, or a function of
        (the while instruction, its loop depth: 0 for a loop in the entry computation)."""
        self.comps, self.entry = parse_module(hlo_text)
        self.unknown_trips = (
            unknown_trips if callable(unknown_trips) else (lambda instr, depth: unknown_trips)
        )
        self._memo: dict = {}

    def cost(self, name: str | None = None, depth: int = 0) -> Cost:
        """What one execution of computation `name` (default: the entry) costs."""
        name = name or self.entry
        key = (name, depth)
        if key not in self._memo:
            self._memo[key] = self._cost(self.comps[name], depth)
        return self._memo[key]

    def whiles(self, name: str | None = None) -> list[Instr]:
        """The while instructions of computation `name` (default: the entry)."""
        return [i for i in self.comps[name or self.entry].instrs if i.opcode == "while"]

    def loop_body(self, instr: Instr) -> str:
        return _attr(instr.attrs, "body")

    def _cost(self, comp: Computation, depth: int) -> Cost:
        total = Cost()
        for instr in comp.instrs:
            op = instr.opcode
            if op in _FREE or _ASYNC_DONE.search(op):
                continue
            if op == "while":
                trips = trip_count(instr, self.comps)
                inner = Cost()
                if trips is None:
                    trips = self.unknown_trips(instr, depth)
                    inner.unknown_loops = 1
                inner.add(self.cost(_attr(instr.attrs, "body"), depth + 1), trips)
                inner.add(self.cost(_attr(instr.attrs, "condition"), depth + 1), trips + 1)
                total.add(inner)
                continue
            if op == "conditional":  # the dearest branch: an upper bound
                branches = _called(instr.attrs, "branch_computations") or [
                    c
                    for c in (
                        _attr(instr.attrs, "true_computation"),
                        _attr(instr.attrs, "false_computation"),
                    )
                    if c
                ]
                costs = [self.cost(b, depth) for b in branches]
                if costs:
                    total.add(max(costs, key=lambda c: c.bytes))
                continue
            if (
                op in ("call", "async-start")
                or op.endswith("-start")
                and _attr(instr.attrs, "calls")
            ):
                called = _attr(instr.attrs, "to_apply") or _attr(instr.attrs, "calls")
                if called in self.comps and op == "call":
                    total.add(self.cost(called, depth))
                    continue
            nbytes, flops = self._instr_cost(instr, comp)
            total.bytes += nbytes
            total.flops += flops
            total.by_opcode[op] = total.by_opcode.get(op, 0) + nbytes
            if nbytes:
                total.top.append((nbytes, comp.name, instr.name, op, instr.shape[:120]))
        return total

    def _instr_cost(self, instr: Instr, comp: Computation) -> tuple[int, int]:
        op = instr.opcode
        operand_bytes = [array_bytes(comp.shapes.get(o, "")) for o in instr.operands]
        out = array_bytes(instr.shape)
        if op == "fusion":
            return self._fusion_cost(instr, comp, operand_bytes, out)
        if op in ("dot", "convolution"):
            return sum(operand_bytes) + out, _dot_flops(instr, comp.shapes)
        # ((source), slice, context): reads the slice, writes it where it lands
        if op == "slice-start":
            parts = _split_top(instr.shape.strip()[1:-1])
            if len(parts) >= 2:
                return array_bytes(parts[1], hbm_only=False) + array_bytes(parts[1]), 0
        if op.endswith("-start"):  # async: its result tuple holds the source and the destination
            return out, 0
        if op == "custom-call" and (estimate := kernel_estimate(instr.attrs)) is not None:
            return estimate
        if op == "custom-call" and 'custom_call_target="AllocateBuffer"' in instr.attrs:
            return 0, 0  # reserves a buffer (libtpu, for a copy to fill), moves nothing
        if op in _SLICING:  # reads what it takes (and the indices)
            taken = (
                array_bytes(instr.shape, hbm_only=False)
                if operand_bytes and operand_bytes[0]
                else 0
            )
            return taken + out + sum(operand_bytes[1:]), 0
        if op == "dynamic-update-slice":  # in place: the update is read and written
            return 2 * operand_bytes[1] + sum(operand_bytes[2:]), 0
        if op == "scatter":
            return 2 * sum(operand_bytes[2:]) + operand_bytes[1], 0
        return sum(operand_bytes) + out, 0

    def _fusion_cost(
        self, instr: Instr, comp: Computation, operand_bytes: list[int], out: int
    ) -> tuple[int, int]:
        fused = self.comps.get(_attr(instr.attrs, "calls") or "")
        if fused is None:
            return sum(operand_bytes) + out, 0
        params = {i.name: int(i.operands[0]) for i in fused.instrs if i.opcode == "parameter"}
        users: dict = {}
        for i in fused.instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = fused.root
        outputs = [fused.instr(o) for o in root.operands] if root.opcode == "tuple" else [root]
        written, in_place = 0, set()
        for o in outputs:
            if o is not None and o.opcode in _IN_PLACE and o.operands[0] in params:
                in_place.add(o.operands[0])
                update = o.operands[1] if o.opcode == "dynamic-update-slice" else o.operands[2]
                written += array_bytes(fused.shapes.get(update, ""))
            elif o is not None:
                written += array_bytes(o.shape)
        read = 0
        for pname, index in params.items():
            if index >= len(operand_bytes) or not operand_bytes[index]:
                continue
            if pname in in_place and all(
                u.opcode in _IN_PLACE and u.operands[0] == pname for u in users.get(pname, [])
            ):
                continue
            read += min(operand_bytes[index], self._param_read(fused, pname, operand_bytes[index]))
        return read + written, self._fused_flops(fused)

    def _param_read(self, fused: Computation, pname: str, full: int, outer: tuple = ()) -> int:
        """Bytes a fused computation reads of its parameter `pname` (an HBM operand of `full`
        bytes): what its slices take, through nested fusions; all of it for any other use.
        `outer`: the (computation, nested fusion instruction name) pairs it is nested in, whose
        users read what this computation hands out as its root."""
        root = fused.root
        if pname == root.name or root.opcode == "tuple" and pname in root.operands:
            # handed out whole (libtpu wraps a dot's weight in a bitcast fusion): read by the
            # nested fusion's users, or by the fusion's own output (all of it)
            if root.opcode == "tuple" or not outer:
                return full
            (caller, name), rest = outer[-1], outer[:-1]
            return self._param_read(caller, name, full, rest)
        total = 0
        for user in fused.instrs:
            if pname not in user.operands:
                continue
            if (
                user.opcode in _SLICING
                and user.operands[0] == pname
                and pname not in user.operands[1:]
            ):
                # wherever the slice goes (often VMEM)
                total += array_bytes(user.shape, hbm_only=False)
            # a view inside a fusion: what reads it reads
            elif user.opcode in ("bitcast", "reshape"):
                total += self._param_read(fused, user.name, full, outer)
            elif (
                user.opcode == "fusion"
                and (inner := self.comps.get(_attr(user.attrs, "calls") or "")) is not None
            ):
                inner_params = {
                    int(i.operands[0]): i.name for i in inner.instrs if i.opcode == "parameter"
                }
                for position, operand in enumerate(user.operands):
                    if operand == pname and position in inner_params:
                        total += self._param_read(
                            inner, inner_params[position], full, outer + ((fused, user.name),)
                        )
            else:
                return full
        return total

    def _fused_flops(self, fused: Computation) -> int:
        flops = 0
        for i in fused.instrs:
            if i.opcode in ("dot", "convolution"):
                flops += _dot_flops(i, fused.shapes)
            elif (
                i.opcode == "fusion"
                and (inner := self.comps.get(_attr(i.attrs, "calls") or "")) is not None
            ):
                flops += self._fused_flops(inner)
        return flops


def step_cost(hlo_text: str, unknown_trips: int = 1) -> Cost:
    """One trip of the step loop of a compiled chunk program (the first while loop of its
    entry computation whose trip count is not stated): its body and condition once, every
    loop inside at its trip count (`unknown_trips` where it states none)."""
    module = ModuleCost(hlo_text, unknown_trips)
    loops = [w for w in module.whiles() if trip_count(w, module.comps) is None] or module.whiles()
    if not loops:
        raise ValueError("the program has no while loop in its entry computation: not a step loop")
    step = Cost()
    step.add(module.cost(module.loop_body(loops[0]), 1))
    step.add(module.cost(_attr(loops[0].attrs, "condition"), 1))
    return step


def program_cost(hlo_text: str, unknown_trips: int = 1) -> Cost:
    """One execution of a compiled program, loops at their trip counts."""
    return ModuleCost(hlo_text, unknown_trips).cost()
