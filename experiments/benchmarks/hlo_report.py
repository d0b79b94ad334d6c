"""What a compiled XLA program does, read from XLA's own text: the FLOPs of its matrix
products and the largest temporary buffers with the operations that make them.

XLA's HloCostAnalysis, run on an optimized GPU module, counts a while loop's body once and
a kernel (custom call) as nothing; this walker counts each `dot` where it sits (inside
fusions), multiplies while bodies by the trip count XLA proved (`known_trip_count`), takes
a conditional's largest branch, and lists the custom calls it could not count, so a caller
knows what the figure leaves out. Buffers come from XLA's buffer-assignment dump (the
`xla_dump_to` debug option), the exact allocation XLA made.
"""

import math
import pathlib
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s+=\s+(.*)$")
_ARRAY = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _split_shape(rest):
    """'SHAPE opcode(...)...' -> (shape text, remainder starting at the opcode)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _dims(shape):
    m = _ARRAY.match(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _attr_list(text, key):
    m = re.search(key + r"=\{([0-9,]*)\}", text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _called(text, key):
    m = re.search(key + r"=%([\w.\-]+)", text)
    return m.group(1) if m else None


def parse_module(text):
    """{computation: [(name, shape, opcode, remainder)]} of an HLO module's text."""
    computations, current = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = _INSTRUCTION.match(line)
        if inst is None or current is None:
            continue
        shape, rest = _split_shape(inst.group(2))
        opcode = rest.split("(", 1)[0]
        current.append((inst.group(1), shape, opcode, rest))
    return computations


class DotFlops:
    """FLOPs of the matrix products of an optimized HLO module (module docstring)."""

    def __init__(self, text):
        self.computations = parse_module(text)
        self.shapes = {name: shape for insts in self.computations.values()
                       for name, shape, _, _ in insts}
        self.custom_calls = {}  # target -> count (not counted)
        self.unknown_trip_counts = 0
        self._memo = {}
        entry = re.search(r"^ENTRY\s+%(\S+)", text, re.M)
        self.total = self.flops(entry.group(1)) if entry else 0

    def flops(self, computation):
        if computation not in self._memo:
            self._memo[computation] = sum(self._instruction(*inst)
                                          for inst in self.computations.get(computation, []))
        return self._memo[computation]

    def _instruction(self, name, shape, opcode, rest):
        if opcode == "dot":
            lhs = re.match(r"dot\(%([\w.\-]+)", rest).group(1)
            lhs_dims = _dims(self.shapes.get(lhs, ""))
            contract = math.prod(lhs_dims[i] for i in _attr_list(rest, "lhs_contracting_dims"))
            return 2 * math.prod(_dims(shape)) * contract
        if opcode == "while":
            trip = _TRIP.search(rest)
            if trip is None:
                self.unknown_trip_counts += 1
            return (int(trip.group(1)) if trip else 1) * self.flops(_called(rest, "body"))
        if opcode == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                     else [_called(rest, k) for k in ("true_computation",
                                                       "false_computation")])
            return max((self.flops(b) for b in names if b), default=0)
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            key = target.group(1) if target else "?"
            self.custom_calls[key] = self.custom_calls.get(key, 0) + 1
            return 0
        called = _called(rest, "calls")
        return self.flops(called) if called and opcode in ("fusion", "call") else 0


def op_names(text):
    """{instruction name: the JAX operation it came from (metadata op_name)}; a fusion
    without one gets that of the last instruction of its computation that has one (its
    root, most often)."""
    computations = parse_module(text)
    inner = {}
    for comp, insts in computations.items():
        for _, _, _, rest in reversed(insts):
            m = _OP_NAME.search(rest)
            if m:
                inner[comp] = m.group(1)
                break
    out = {}
    for insts in computations.values():
        for name, _, _, rest in insts:
            m = _OP_NAME.search(rest)
            called = _called(rest, "calls")
            if m:
                out[name] = m.group(1)
            elif called in inner:
                out[name] = inner[called]
    return out


_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ ([^ ]+) @[^>]*> \(size=(\d+),offset=\d+\): (.*)$")


def temp_buffers(assignment_text):
    """[(bytes, instruction, shape)] of the values in the temporary allocations of a
    buffer-assignment dump, largest first."""
    out, in_temp = [], False
    for line in assignment_text.splitlines():
        alloc = _ALLOCATION.match(line)
        if alloc:
            in_temp = "preallocated-temp" in alloc.group(2)
            continue
        value = _VALUE.match(line)
        if value and in_temp:
            out.append((int(value.group(2)), value.group(1), value.group(3).split("{")[0]))
    return sorted(out, reverse=True)


def dump_files(dump_dir):
    """(optimized HLO text, buffer-assignment text) of the one module dumped in dump_dir."""
    d = pathlib.Path(dump_dir)
    hlo = sorted(d.glob("*after_optimizations.txt"))
    assignment = sorted(d.glob("*after_optimizations-buffer-assignment.txt"))
    if not hlo or not assignment:
        raise FileNotFoundError(f"no optimized module and buffer assignment in {d}")
    return hlo[-1].read_text(), assignment[-1].read_text()


def largest_temporaries(dump_dir, count=6):
    """The `count` largest temporary buffers of the module dumped in dump_dir:
    [{"bytes", "shape", "instruction", "op"}], op: the JAX operation that made it."""
    hlo, assignment = dump_files(dump_dir)
    names = op_names(hlo)
    return [{"bytes": size, "shape": shape, "instruction": inst, "op": names.get(inst, "")}
            for size, inst, shape in temp_buffers(assignment)[:count]]
