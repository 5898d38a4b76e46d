"""check_plans: each plan checked on its own, the matched subgraph before against its replacement.

For every plan of a report, the nodes it removes (and the shared ones it may drop) are run on
random inputs of their recorded shapes (normal values times 1/16 to 16, so small ones and ones
past a clamp's 6 are drawn), and so are its new nodes and constants; each output the plan
redirects (``replace``: old -> new) must agree within a tolerance, and each new node must compute
the shape and dtype its plan declares (the program's meta says so). A wrong plan is named,
not just a wrong program. Plans whose ops have no CPU kernels (the Vulkan ``et_vk`` ops) or that
read values with no known shape are reported as not checked, with the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, final

import torch
from torch._subclasses.fake_tensor import FakeTensor

from adapters.snap import Captured, Program, capture_program, changed_since
from adapters.torchnames import dtype_of, resolve_target
from adapters.weights import materialize, plain_torch
from fxpure.families import CLONE, EXPAND, FLATTEN, VIEW
from fxpure.plan import RewritePlan, RewriteReport, planned_on
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, TensorSpec, node_refs
from fxpure.weights import sources


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCheck:
    """One plan's local check: ``ok`` None when it could not be run (``note`` says why)."""

    rule: str
    anchor: str
    ok: bool | None
    max_rel: float = 0.0
    note: str = ""


class _Skip(ValueError):
    """This plan cannot be evaluated on the host (the message says why)."""


# the size arithmetic a dynamic program computes reshapes with (edge: sym_size, then Python's operators)
_SIZE_OPS: Mapping[str, Any] = {
    "aten.sym_size.int": lambda x, dim: x.shape[dim],
    "_operator.mul": operator.mul,
    "_operator.add": operator.add,
    "_operator.sub": operator.sub,
    "_operator.floordiv": operator.floordiv,
}


def _bound(value: Any) -> int | None:
    """A range's bound as an int, None where it has none (torch's ``int_oo`` says it is finite)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def symbol_values(program: Program, *, least: int = 2) -> dict[str, int]:
    """A value for each symbolic size the program declares: its lower bound, at least ``least`` and
    within the upper bound (as ``fxpure apply --verify`` feeds the whole program). A size derived
    from others (``2*s0``) is not one: it is computed from theirs (:func:`size_value`)."""
    out: dict[str, int] = {}
    for sym, bounds in (getattr(program, "range_constraints", None) or {}).items():
        if not getattr(sym, "is_Symbol", True):
            continue
        low, high = _bound(bounds.lower), _bound(bounds.upper)
        value = max(least if low is None else low, least)
        out[str(sym)] = value if high is None else min(value, high)
    return out


def size_value(d: int | str, symbols: Mapping[str, int]) -> int:
    """A size; a symbolic one (``s0``, or an expression of sizes such as ``2*s0``) from ``symbols``
    (:func:`symbol_values`); raises ``ValueError`` (a ``_Skip``) if it names another."""
    if isinstance(d, int):
        return d
    if d in symbols:
        return symbols[d]
    import sympy

    try:
        value = sympy.sympify(d).subs({sympy.Symbol(k): v for k, v in symbols.items()})
        return int(value)
    except (sympy.SympifyError, TypeError, ValueError) as e:
        raise _Skip(f"no value for the size {d}") from e


def _random(spec: TensorSpec, symbols: Mapping[str, int], g: torch.Generator) -> torch.Tensor:
    shape = [size_value(d, symbols) for d in spec.shape]
    dtype = dtype_of(spec.dtype)
    if dtype.is_floating_point:  # normal values times 1/16 to 16: small ones, and ones past a clamp's 6
        scale = torch.exp2(torch.empty(shape).uniform_(-4.0, 4.0, generator=g))
        return (torch.randn(shape, generator=g) * scale).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -128), min(info.max, 127) + 1, shape, generator=g, dtype=dtype)


def _value(arg: Arg, env: Mapping[str, Any]) -> Any:
    if isinstance(arg, NodeRef):
        return env[arg.name]
    if isinstance(arg, tuple):
        return [_value(a, env) for a in arg]
    if isinstance(arg, DTypeArg):
        return dtype_of(arg.name)
    return arg


def _run(node: NodeSnapshot, dialect: str, env: Mapping[str, Any]) -> Any:
    if node.target.startswith("et_vk."):
        raise _Skip("its et_vk kernels run in the Vulkan delegate (the CPU reference kernels do not undo the packing)")
    fn = (
        operator.getitem
        if node.target == "getitem"
        else _SIZE_OPS.get(node.target) or resolve_target(node.target, dialect)
    )
    with torch.no_grad():
        return fn(*(_value(a, env) for a in node.args), **{k: _value(v, env) for k, v in node.kwargs.items()})


def _given_tolerance(value: object) -> float:
    """A relative tolerance as a float: a number of 0 or more (``np.float32`` and a 0-d tensor too)."""
    try:
        number = float(value) if not isinstance(value, (bool, str, bytes)) else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = None
    if number is None:
        raise TypeError(f"tolerance must be a number, got {type(value).__name__}")
    if not number >= 0:  # (nan too)
        raise ValueError(f"tolerance must be 0 or more, got {value!r}")
    return number


def _data(cap: Captured, keys: Iterable[str]) -> None:
    """Raises ``_Skip`` if a constant of ``keys`` holds no data (on the meta device, or fake)."""
    for k in keys:
        t = cap.tensors.get(k)
        if t is not None and (t.is_meta or isinstance(t, FakeTensor)):
            raise _Skip(f"{cap.snap.constants[k].key} holds no data (on the meta device, or fake)")


@dataclass
class _Region:
    """One side of a plan: nodes to run in order, reading ``env`` (inputs and constants)."""

    snap: GraphSnapshot
    cap: Captured
    env: dict[str, Any]
    symbols: Mapping[str, int]
    g: torch.Generator

    def get(self, name: str) -> Any:
        if name not in self.env:
            self.env[name] = self._outside(name)
        return self.env[name]

    def _outside(self, name: str) -> Any:
        info = self.snap.constants.get(name)
        if info is not None:
            _data(self.cap, (name,) if info.source is None else sources(info.source))
            return self.cap.tensors[name] if info.source is None else materialize(info.source, self.cap.tensors)
        node = self.snap.node(name)
        if node.target in _SIZE_OPS:  # a size computed from a tensor: the value the inputs here give
            for r in dict.fromkeys(node_refs(node)):
                self.get(r)
            return _SIZE_OPS[node.target](*(_value(a, self.env) for a in node.args))
        spec = node.tensor_spec
        if spec is None:
            raise _Skip(f"it reads {name}, whose value is not a tensor of known shape")
        if node.target in _DEQUANTIZE:
            return self._dequantized(node, _DEQUANTIZE[node.target])
        if node.target in _VIEWS and node.args and isinstance(node.args[0], NodeRef):
            return self._viewed(node, spec)
        return _random(spec, self.symbols, self.g)

    def _viewed(self, node: NodeSnapshot, spec: TensorSpec) -> Any:
        """A view or copy of a value, computed from that value: two such nodes of one value are one
        value, as the program computes them (each linear's own ``expand``/``view_copy`` of an edge
        program's input, which ``concat-parallel-linears`` joins: drawn apart, a right plan failed)."""
        try:
            for r in dict.fromkeys(node_refs(node)):
                self.get(r)
            return _run(node, self.snap.dialect, self.env)
        except Exception:  # (a value it views unknown, or strides it does not allow: drawn itself, as before)
            return _random(spec, self.symbols, self.g)

    def _dequantized(self, node: NodeSnapshot, at: int) -> Any:
        """A dequantize's value on its own grid (random integers in its range, dequantized), as the
        program computes it: a plan that quantizes it again (a q/dq pair after a view) keeps it."""
        q, low, high = node.arg(0, "input"), node.arg(at, "quant_min"), node.arg(at + 1, "quant_max")
        if isinstance(q, NodeRef) and q.name not in self.env and isinstance(low, int) and isinstance(high, int):
            self.env[q.name] = self.get(q.name).clamp(low, high)
        for r in dict.fromkeys(node_refs(node)):
            self.get(r)
        return _run(node, self.snap.dialect, self.env)

    def run(self, nodes: list[NodeSnapshot], dialect: str) -> None:
        local = {n.name for n in nodes}
        for n in nodes:
            for r in dict.fromkeys(node_refs(n)):
                if r not in local:
                    self.get(r)
            self.env[n.name] = _run(n, dialect, self.env)


def _rel(got: Any, want: Any) -> float:
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return 0.0 if got == want else float("inf")
    if got.shape != want.shape:
        return float("inf")
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 1.0
    return float(diff / (scale or 1.0))


def _misdeclared(node: NodeSnapshot, value: Any, symbols: Mapping[str, int]) -> str | None:
    """How a new node's value differs from the spec its plan declares (what the program's meta will
    say of it), or None. A size with no value here is not compared."""
    declared, values = node.spec, value if isinstance(value, (list, tuple)) else (value,)
    specs = declared if isinstance(declared, tuple) else (declared,)
    if not any(isinstance(v, torch.Tensor) for v in values):
        return None
    if len(specs) != len(values):
        return f"{node.name} declares {len(specs)} values and computes {len(values)}"
    for spec, v in zip(specs, values, strict=True):
        if not isinstance(v, torch.Tensor):
            continue
        got = f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        if spec is None:
            return f"{node.name} declares no shape or dtype, and computes {got}"
        try:
            sizes = [size_value(d, symbols) for d in spec.shape]
        except _Skip:
            sizes = list(v.shape)
        if sizes != list(v.shape) or dtype_of(spec.dtype) != v.dtype:
            return f"{node.name} declares {spec.shape} {spec.dtype}, and computes {got}"
    return None


def _check(cap: Captured, snap: GraphSnapshot, p: RewritePlan, tolerance: float | None, seed: int) -> PlanCheck:
    removed = set(p.erase) | {old for old, _ in p.replace} | set(p.prune)
    before_nodes = [n for n in snap.nodes if n.name in removed and n.op == "call_function"]
    new_nodes = [
        NodeSnapshot(name=n.name, op="call_function", target=n.target, args=n.args, kwargs=n.kwargs, spec=n.spec)
        for n in p.nodes
    ]
    if tolerance is None:
        tolerance = _plan_tolerance(before_nodes + new_nodes)
    symbols = symbol_values(cap.program)
    inputs: dict[str, Any] = {}
    try:
        before = _Region(snap, cap, inputs, symbols, torch.Generator().manual_seed(seed))
        before.run(before_nodes, snap.dialect)
        for old, _ in p.replace:  # a value whose uses the plan takes that no node here computes (an input)
            before.get(old)
    except _Skip as e:
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=None, note=f"not checked: {e}")
    except Exception as e:  # the original fails on these inputs: they say nothing of the plan
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=None, note=f"not checked: {type(e).__name__}: {e}")
    # what the plan removes: a pruned node the replacement reads stays, and so does a node whose
    # uses it takes but reads (a node inserted after it)
    read = {r for n in new_nodes for r in node_refs(n)} - {n.name for n in new_nodes}
    gone = set(p.erase) | {old for old, _ in p.replace if old not in read}
    shared = {k: v for k, v in before.env.items() if k not in gone}
    after = _Region(snap, cap, dict(shared), symbols, torch.Generator().manual_seed(seed + 1))
    try:
        for c in p.constants:  # (expressions read the program's own constants: derived ones are inlined)
            _data(cap, sources(c.expr))
            after.env[c.name] = materialize(c.expr, cap.tensors)
        after.run(new_nodes, snap.dialect)
    except _Skip as e:
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=None, note=f"not checked: {e}")
    except Exception as e:
        made = {n.name for n in new_nodes} | set(shared) | {c.name for c in p.constants}
        if any(k not in made and k not in snap.constants for k in after.env):  # values only it drew
            return PlanCheck(rule=p.rule, anchor=p.anchor, ok=None, note=f"not checked: {type(e).__name__}: {e}")
        # the replacement fails on the very values the original ran on: the plan is wrong
        note = f"the replacement fails where the original ran: {type(e).__name__}: {e}"
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=False, note=note)
    wrong = next((w for n in new_nodes if (w := _misdeclared(n, after.env[n.name], symbols)) is not None), None)
    if wrong is not None:
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=False, note=wrong)
    worst = max((_rel(after.env[new], before.env[old]) for old, new in p.replace), default=0.0)
    # a plan that quantizes its output again (a q/dq pair after a conv of a quantized program)
    # differs from the float it replaces by that rounding: compare where the program quantizes
    quantizes = worst > tolerance and any(n.target in _QUANTIZE for n in new_nodes)
    if quantizes and all(_requantized(snap, cap, o, before.env[o], after.env[n], symbols) for o, n in p.replace):
        note = "equal where the program quantizes the output"
        return PlanCheck(rule=p.rule, anchor=p.anchor, ok=True, max_rel=worst, note=note)
    note = "" if worst <= tolerance else f"max relative difference {worst:.3g} > {tolerance:g}"
    return PlanCheck(rule=p.rule, anchor=p.anchor, ok=worst <= tolerance, max_rel=worst, note=note)


# views and copies of a value: computed from it where a region reads one (see _Region._viewed)
_VIEWS = VIEW.targets | FLATTEN.targets | EXPAND.targets | CLONE.targets

# each dequantize by the position of its quant_min (quant_max follows)
_DEQUANTIZE: Mapping[str, int] = {
    "quantized_decomposed.dequantize_per_tensor.default": 3,
    "quantized_decomposed.dequantize_per_tensor.tensor": 3,
    "quantized_decomposed.dequantize_per_channel.default": 4,
}
_QUANTIZE = frozenset(
    {f"quantized_decomposed.quantize_per_{k}.{o}" for k in ("tensor", "channel") for o in ("default", "tensor")}
)


def _requantized(snap: GraphSnapshot, cap: Captured, old: str, want: Any, got: Any, symbols: Mapping[str, int]) -> bool:
    """Whether the program's next quantize of ``old`` (per tensor, through the ops between that read
    nothing else computed, a relu) stores the same integers for ``want`` and ``got`` (``old``'s value
    and its replacement's): equal, but for one step where ``want`` lies at a rounding tie (float
    sums in another order may round the other way there)."""
    chain: list[NodeSnapshot] = []
    name = old
    while len(chain) < 4:
        users = snap.users.get(name, ())
        node = snap.node(users[0]) if len(users) == 1 else None
        if node is None or node.op != "call_function":
            return False
        if any(r != name and r not in snap.constants for r in node_refs(node)):
            return False
        chain.append(node)
        if node.target in _QUANTIZE:
            break
        name = node.name
    else:
        return False
    q = chain[-1]
    scale, zero = q.arg(1, "scale"), q.arg(2, "zero_point")
    if not isinstance(scale, float) or not isinstance(zero, int):  # per channel: not compared here
        return False
    stored, read = [], []
    for value in (want, got):
        region = _Region(snap, cap, {old: value}, symbols, torch.Generator().manual_seed(0))
        region.run(chain, snap.dialect)
        stored.append(region.env[q.name])
        read.append(region.env[chain[-2].name] if len(chain) > 1 else value)
    a, b = stored
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    steps = (a.long() - b.long()).abs()
    units = read[0].double() / scale + zero
    at_tie = ((units - units.floor()) - 0.5).abs() < 1e-3
    return bool((steps == 0).logical_or((steps == 1).logical_and(at_tie)).all())


def default_tolerance(program: Program) -> float:
    """1e-4, or eight steps of the least precise floating dtype the program computes in (float16
    and bfloat16 round much coarser than that, and so does an output cast to float32 from them): the
    values of its calls (an input or a weight only cast to float32 computes nothing in its dtype)."""
    values = [n.meta.get("val") for n in program.graph.nodes if n.op == "call_function"]
    return _tolerance({v.dtype for v in values if isinstance(v, torch.Tensor)})


def _tolerance(dtypes: set[torch.dtype]) -> float:
    return max([1e-4, *(8 * torch.finfo(d).eps for d in dtypes if d.is_floating_point)])


def _plan_tolerance(nodes: list[NodeSnapshot]) -> float:
    """:func:`default_tolerance` of what a plan's region computes in (its old and new nodes)."""
    specs = [s for n in nodes for s in (n.spec if isinstance(n.spec, tuple) else (n.spec,))]
    return _tolerance({dtype_of(s.dtype) for s in specs if s is not None})


def check_plans(
    program: Program | Captured, report: RewriteReport, *, tolerance: float | None = None, seed: int = 0
) -> list[PlanCheck]:
    """Check each plan of ``report`` (made on ``program`` before it was changed) on its own, within
    ``tolerance`` (relative; by default that of the dtypes the plan's old and new nodes compute in,
    as :func:`default_tolerance` gives a program's). Raises ValueError for a report made on
    another program (no plan of it could be checked here) or a negative tolerance, TypeError for
    what is no report or no number."""
    if not isinstance(report, RewriteReport):
        raise TypeError(f"expected a RewriteReport (an outcome's .report), got {type(report).__name__}")
    if tolerance is not None:
        tolerance = _given_tolerance(tolerance)
    cap = program if isinstance(program, Captured) else capture_program(program)
    changed = changed_since(report.before, cap.snap)
    if changed is not None:
        raise ValueError(f"the report was planned on another program: {changed}")
    out: list[PlanCheck] = []
    with plain_torch():
        for i, (current, stage) in enumerate(planned_on(report)):
            out.extend(_check(cap, current, p, tolerance, seed + 2 * i) for p in stage)
    return out
