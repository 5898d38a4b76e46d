"""apply / transform: realise a rewritten snapshot on the live program, transactionally.

Everything that can fail happens first (materialising constants, resolving ops,
building a complete new graph, fake values); only then is the program touched,
and a failure while committing rolls every change back.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, final

import torch
from returns.result import Failure, Result, Success
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputSpec, TensorArgument

import fxpure
from adapters.snap import Captured, Program, capture_program
from adapters.torchnames import SOURCE_FNS, dtype_of, resolve_target
from adapters.weights import materialize
from fxpure.plan import RewritePlan, RewriteReport, Rule
from fxpure.reasons import NonFinite, Reason
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, Opaque, TensorSpec
from fxpure.weights import subexpressions

V = TypeVar("V")

# meta a new node inherits from the node it was planned from
INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn", "from_node", "seq_nr")


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TransformError:
    """Why a transform did not happen; the program is unchanged."""

    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class TransformOutcome:
    """What a transform did (or, with ``dry_run``, would do)."""

    report: RewriteReport
    changed: bool
    added: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    constant_bytes_before: int = 0
    constant_bytes_after: int = 0


class _ApplyError(Exception):
    """Internal: a reason to abort before anything is committed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _tensors(val: Any) -> list[torch.Tensor]:
    return [v for v in (val if isinstance(val, (list, tuple)) else (val,)) if isinstance(v, torch.Tensor)]


@dataclass
class _Fakes:
    """The graph's fake mode and (read when first needed) its symbolic sizes by printed name.
    New fake values are made once per spec and shared: fake tensors are immutable."""

    gm: torch.fx.GraphModule
    mode: Any = None
    vals: dict[TensorSpec, Any] = field(default_factory=dict)
    _symbols: dict[str, Any] | None = None

    @staticmethod
    def of(gm: torch.fx.GraphModule) -> _Fakes:
        for n in gm.graph.nodes:
            for v in _tensors(n.meta.get("val")):
                mode = getattr(v, "fake_mode", None)
                if mode is not None:
                    return _Fakes(gm=gm, mode=mode)
        return _Fakes(gm=gm)

    def symbols(self) -> dict[str, Any]:
        if self._symbols is None:
            self._symbols = {
                str(d): d
                for n in self.gm.graph.nodes
                for v in _tensors(n.meta.get("val"))
                for d in v.shape
                if isinstance(d, torch.SymInt)
            }
        return self._symbols

    def value(self, spec: TensorSpec) -> Any:
        """A contiguous fake tensor of ``spec`` from the graph's own fake mode, shared per spec."""
        if self.mode is None:
            return None
        if spec not in self.vals:
            symbols = {} if spec.is_static else self.symbols()
            shape = [d if isinstance(d, int) else symbols[d] for d in spec.shape]
            with self.mode:
                self.vals[spec] = torch.empty(shape, dtype=dtype_of(spec.dtype))
        return self.vals[spec]


def _source_fn_stack(name: str, fn_name: str, source: torch.fx.Node, same_op: bool) -> list[tuple[str, Any]]:
    """The provenance's stack with the last frame naming this node and its own function.

    A node of the same op keeps the provenance's function (e.g. the ``nn.Conv2d`` class)
    so a quantizer partitions each new conv on its own, exactly as for hand-written code.
    """
    stack = list(source.meta.get("source_fn_stack") or [("", None)])
    fn = stack[-1][1] if same_op and stack[-1][1] is not None else SOURCE_FNS.get(fn_name)
    return [*stack[:-1], (name, fn)]


@dataclass
class _Builder:
    """Builds the new fx.Graph from the rewritten snapshot (no program mutation)."""

    cap: Captured
    after: GraphSnapshot
    tensors: dict[str, torch.Tensor]
    graph: torch.fx.Graph = field(init=False)
    env: dict[str, torch.fx.Node] = field(default_factory=dict)
    old: dict[str, torch.fx.Node] = field(default_factory=dict)
    fakes: _Fakes = field(init=False)

    def __post_init__(self) -> None:
        g = self.cap.gm.graph
        # no owning module until commit: new get_attr targets do not exist yet
        self.graph = torch.fx.Graph(tracer_cls=g._tracer_cls, tracer_extras=g._tracer_extras)
        self.graph._codegen = copy.deepcopy(g._codegen)
        self.graph._co_fields = dict(g._co_fields)
        self.old = {n.name: n for n in g.nodes}
        self.fakes = _Fakes.of(self.cap.gm)

    def to_fx(self, arg: Arg) -> Any:
        if isinstance(arg, NodeRef):
            return self.env[arg.name]
        if isinstance(arg, tuple):
            return [self.to_fx(a) for a in arg]
        if isinstance(arg, DTypeArg):
            return dtype_of(arg.name)
        if isinstance(arg, Opaque):
            raise _ApplyError("unsupported-argument", f"cannot rebuild literal {arg.text}")
        return arg

    def rebuild(self, old: Any, arg: Arg) -> Any:
        """Old argument values with node references re-pointed as the snapshot says."""
        if isinstance(arg, NodeRef):
            return self.env[arg.name]
        if isinstance(old, (list, tuple)) and isinstance(arg, tuple) and len(old) == len(arg):
            return type(old)(self.rebuild(o, a) for o, a in zip(old, arg, strict=True))
        if isinstance(old, torch.fx.Node):
            raise _ApplyError("apply-failed", f"argument {old.name} has no counterpart in the plan")
        return old

    def add(self, rec: NodeSnapshot) -> None:
        before = self.cap.snap
        old = self.old.get(rec.name)
        if old is not None and before.node(rec.name) is rec:
            node = self.graph.node_copy(old, lambda n: self.env[n.name])
        elif old is not None:
            args = tuple(self.rebuild(o, a) for o, a in zip(old.args, rec.args, strict=True))
            kwargs = {k: self.rebuild(old.kwargs[k], a) for k, a in rec.kwargs.items()}
            node = self.graph.create_node(old.op, old.target, args, kwargs, name=old.name, type_expr=old.type)
            node.meta = copy.copy(old.meta)
        elif rec.name in self.tensors:
            node = self._constant(rec)
        else:
            node = self._new(rec)
        # FX renames candidates that shadow builtins (e.g. "input"); the snapshot's names are unique, keep them
        node.name = rec.name
        self.env[rec.name] = node

    def _constant(self, rec: NodeSnapshot) -> torch.fx.Node:
        node = self.graph.placeholder(rec.name) if self.after.lifted else self.graph.get_attr(rec.name)
        if isinstance(rec.spec, TensorSpec) and self.fakes.mode is not None:
            node.meta["val"] = self.fakes.value(rec.spec)
        return node

    def _new(self, rec: NodeSnapshot) -> torch.fx.Node:
        try:
            target = resolve_target(rec.target, self.after.dialect)
        except ValueError as e:
            raise _ApplyError("unknown-op", str(e)) from e
        args = tuple(self.to_fx(a) for a in rec.args)
        kwargs = {k: self.to_fx(v) for k, v in rec.kwargs.items()}
        node = self.graph.create_node("call_function", target, args, kwargs, name=rec.name)
        source = self.old.get(rec.provenance) if rec.provenance else None
        if source is not None:
            same_op = source.target == target
            node.meta.update(
                {k: source.meta[k] for k in INHERITED_META if k in source.meta and (same_op or k != "torch_fn")}
            )
            if rec.source_fn is not None:
                node.meta["source_fn_stack"] = _source_fn_stack(node.name, rec.source_fn, source, same_op)
        spec = rec.spec
        if isinstance(spec, TensorSpec):
            node.meta["val"] = self.fakes.value(spec)
        elif isinstance(spec, tuple):
            node.meta["val"] = tuple(self.fakes.value(s) if s is not None else None for s in spec)
        return node


def _materialize_new(cap: Captured, after: GraphSnapshot) -> dict[str, torch.Tensor]:
    memo: dict[object, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, info in after.constants.items():
        if info.source is None:
            continue
        try:
            t = materialize(info.source, cap.tensors, memo)
        except Exception as e:  # a torch error while computing a constant: abort cleanly
            raise _ApplyError("materialize-failed", f"{name}: {e}") from e
        got = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        if got != (info.spec.shape, info.spec.dtype):
            raise _ApplyError("materialize-failed", f"{name}: computed {got}, planned {info.spec}")
        out[name] = torch.nn.Parameter(t, requires_grad=False) if info.kind == "parameter" else t
    return out


@dataclass
class _Commit:
    """The mutations of one apply, each with its undo, run in order."""

    undo: list[Callable[[], None]] = field(default_factory=list)

    def set_item(self, d: dict[str, V], key: str, value: V) -> None:
        self.del_item(d, key)
        d[key] = value
        self.undo.append(lambda: d.__delitem__(key))

    def del_item(self, d: dict[str, V], key: str) -> None:
        if key not in d:
            return
        old = d.pop(key)
        self.undo.append(lambda: d.__setitem__(key, old))

    def set_list(self, lst: list[Any], items: list[Any]) -> None:
        old = list(lst)
        lst[:] = items
        self.undo.append(lambda: lst.__setitem__(slice(None), old))

    def set_attr(self, obj: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
        """Set (or, with None, delete) a module tensor; undo restores it as parameter or buffer."""
        table = next((t for t in (obj._parameters, obj._buffers) if name in t), None)
        had, old = hasattr(obj, name), getattr(obj, name, None)
        if value is None:
            delattr(obj, name)
        else:
            setattr(obj, name, value)

        def undo() -> None:
            if hasattr(obj, name):
                delattr(obj, name)
            if table is not None:
                table[name] = old
            elif had:
                setattr(obj, name, old)

        self.undo.append(undo)

    def rollback(self) -> None:
        for fn in reversed(self.undo):
            fn()


def _restore_graph(gm: torch.fx.GraphModule) -> Callable[[], None]:
    old = gm.graph

    def undo() -> None:
        gm._graph = old  # no setter: it would recompile, which may be what failed
        old.owning_module = gm
        with contextlib.suppress(Exception):
            gm.recompile()

    return undo


def _owner(gm: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    prefix, _, leaf = path.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), leaf


_INPUT_KINDS: Mapping[str, InputKind] = {
    "parameter": InputKind.PARAMETER,
    "buffer": InputKind.BUFFER,
    "constant": InputKind.CONSTANT_TENSOR,
}


def _input_spec(name: str, kind: str) -> InputSpec:
    persistent = True if kind == "buffer" else None
    return InputSpec(_INPUT_KINDS[kind], TensorArgument(name=name), name, persistent=persistent)


def _commit_ep(
    c: _Commit,
    cap: Captured,
    ep: ExportedProgram,
    graph: torch.fx.Graph,
    new: Mapping[str, torch.Tensor],
    after: GraphSnapshot,
) -> None:
    sig = ep.graph_signature
    specs: list[InputSpec] = []
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        old = cap.specs.get(n.name)
        specs.append(old if old is not None else _input_spec(n.name, after.constants[n.name].kind))
    live = {s.target for s in specs}
    for old_spec in cap.specs.values():
        if old_spec.target is not None and old_spec.target not in live:
            c.del_item(ep.state_dict, old_spec.target)
            c.del_item(ep.constants, old_spec.target)
    for name, t in new.items():
        c.set_item(ep.constants if after.constants[name].kind == "constant" else ep.state_dict, name, t)
    outputs = list(_output_nodes(graph))
    out_specs = [
        OutputSpec(s.kind, TensorArgument(name=o.name), s.target) if isinstance(s.arg, TensorArgument) else s
        for s, o in zip(sig.output_specs, outputs, strict=True)
    ]
    c.set_list(sig.input_specs, specs)
    c.set_list(sig.output_specs, out_specs)


def _output_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    result = graph.output_node().args[0]
    items = result if isinstance(result, (list, tuple)) else (result,)
    return [o for o in items if isinstance(o, torch.fx.Node)]


def _commit_gm(c: _Commit, cap: Captured, graph: torch.fx.Graph, new: Mapping[str, torch.Tensor]) -> None:
    live = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name in cap.snap.constants:
        node = cap.snap.node(name)
        if node.op == "get_attr" and node.target not in live and _attr_exists(cap.gm, node.target):
            owner, leaf = _owner(cap.gm, node.target)
            c.set_attr(owner, leaf, None)
    for name, t in new.items():
        c.set_attr(cap.gm, name, t)


def _attr_exists(gm: torch.nn.Module, path: str) -> bool:
    try:
        owner, leaf = _owner(gm, path)
    except AttributeError:
        return False
    return hasattr(owner, leaf)


def _bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors.values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _non_finite(new: Mapping[str, torch.Tensor]) -> list[str]:
    """Derived floating constants holding inf or NaN (a fold that overflowed its dtype, say)."""
    return [k for k, t in new.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _culprits(report: RewriteReport, bad: Sequence[str]) -> dict[tuple[str, str], Reason]:
    """Every plan whose new constants a non-finite constant is computed from, with the reason."""
    out: dict[tuple[str, str], Reason] = {}
    for name in bad:
        info = report.after.constants[name]
        inside = subexpressions(info.source) if info.source is not None else frozenset()
        for p in report.plans:
            if any(c.expr in inside for c in p.constants):
                out[(p.rule, p.anchor)] = NonFinite(node=p.anchor, constant=name, dtype=info.spec.dtype)
    return out


def _finite_plan(cap: Captured, rules: Sequence[Rule]) -> tuple[RewriteReport, dict[str, torch.Tensor]]:
    """Plan, compute the new constants, and decline (then plan again without) every plan whose
    constants are not finite; raises _ApplyError if a constant cannot be computed."""
    declined: dict[tuple[str, str], Reason] = {}
    while True:
        report = fxpure.plan(cap.snap, rules, declined=declined)
        new = _materialize_new(cap, report.after) if report.plans else {}
        bad = _non_finite(new)
        more = {k: v for k, v in _culprits(report, bad).items() if k not in declined}
        if not bad:
            return report, new
        if not more:
            raise _ApplyError("non-finite-weight", f"{bad[0]} is not finite and no plan computes it")
        declined.update(more)


def realize(
    cap: Captured, after: GraphSnapshot, new: dict[str, torch.Tensor]
) -> tuple[tuple[str, ...], tuple[str, ...], int, int]:
    """Make the live program match ``after`` (its new constants computed: ``new``); raises
    _ApplyError with nothing changed."""
    b = _Builder(cap=cap, after=after, tensors=new)
    try:
        for rec in after.nodes:
            b.add(rec)
        b.graph.lint()
    except (KeyError, RuntimeError, ValueError, TypeError) as e:  # building the new graph failed: nothing was touched
        raise _ApplyError("apply-failed", f"{type(e).__name__}: {e}") from e
    c = _Commit()
    try:
        if isinstance(cap.program, ExportedProgram):
            _commit_ep(c, cap, cap.program, b.graph, new, after)
        else:
            _commit_gm(c, cap, b.graph, new)
        c.undo.append(_restore_graph(cap.gm))
        cap.gm.graph = b.graph
    except Exception as e:
        c.rollback()
        raise _ApplyError("apply-failed", f"commit failed and was rolled back: {type(e).__name__}: {e}") from e
    kept = {k: v for k, v in cap.tensors.items() if k in after.constants}
    added = tuple(n.name for n in after.nodes if n.name in new)
    dropped = tuple(n.name for n in cap.snap.nodes if n.name in cap.snap.constants and n.name not in after.constants)
    return added, dropped, _bytes(cap.tensors), _bytes({**kept, **new})


def _run(
    cap: Captured, report: RewriteReport, new: dict[str, torch.Tensor]
) -> Result[TransformOutcome, TransformError]:
    if not report.plans:
        size = _bytes(cap.tensors)
        return Success(
            TransformOutcome(report=report, changed=False, constant_bytes_before=size, constant_bytes_after=size)
        )
    try:
        added, dropped, before, after = realize(cap, report.after, new)
    except _ApplyError as e:
        return Failure(TransformError(code=e.code, message=str(e)))
    return Success(
        TransformOutcome(
            report=report,
            changed=True,
            added=added,
            dropped=dropped,
            constant_bytes_before=before,
            constant_bytes_after=after,
        )
    )


def _captured(program: Program) -> Result[Captured, TransformError]:
    try:
        return Success(capture_program(program))
    except TypeError as e:
        return Failure(TransformError(code="unsupported-program", message=str(e)))


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic collector: on a large program its full scans, not our work, dominate."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def transform(
    program: Program, rules: Sequence[Rule], *, dry_run: bool = False
) -> Result[TransformOutcome, TransformError]:
    """Plan ``rules`` on ``program`` and apply them in place, all or nothing."""

    def go(cap: Captured) -> Result[TransformOutcome, TransformError]:
        try:
            report, new = _finite_plan(cap, rules)
        except _ApplyError as e:
            return Failure(TransformError(code=e.code, message=str(e)))
        if dry_run:
            return Success(TransformOutcome(report=report, changed=False))
        return _run(cap, report, new)

    with _no_cyclic_gc():
        return _captured(program).bind(go)


def apply(program: Program, plans: Sequence[RewritePlan]) -> Result[TransformOutcome, TransformError]:
    """Apply plans made on ``capture(program)``: ``capture(apply(g, p)) == rewrite(capture(g), p)``."""

    def go(cap: Captured) -> Result[TransformOutcome, TransformError]:
        after = fxpure.rewrite(cap.snap, plans)
        if isinstance(after, Failure):
            return Failure(TransformError(code="plan-conflict", message=str(after.failure())))
        report = RewriteReport(plans=tuple(plans), rejections=(), before=cap.snap, after=after.unwrap())
        try:
            new = _materialize_new(cap, report.after)
        except _ApplyError as e:
            return Failure(TransformError(code=e.code, message=str(e)))
        bad = _non_finite(new)
        if bad:
            return Failure(TransformError(code="non-finite-weight", message=f"{bad[0]} computes to inf or NaN"))
        return _run(cap, report, new)

    with _no_cyclic_gc():
        return _captured(program).bind(go)
