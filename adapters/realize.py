"""apply / transform: make the live program match a rewritten snapshot, in place, all or nothing.

Everything that can fail happens first: materialising the new constants (declining plans whose
weights are not finite), resolving ops, literal arguments, metadata and fake values of the new
nodes. Only then is the program touched, by editing the graph in place where it changed (new
nodes inserted where the snapshot puts them, changed arguments re-pointed, removed nodes erased)
and updating module attributes or the state dict, constants and signature. Every step is
recorded in an undo log that restores the exact previous program on any exit (an exception,
KeyboardInterrupt included); one ``recompile()`` at the end.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections import ChainMap
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar, final

import torch
from returns.result import Failure, Result, Success
from torch._export.verifier import SpecViolationError
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, OutputSpec, TensorArgument
from torch.fx.experimental import symbolic_shapes

import fxpure
from adapters.snap import (
    Captured,
    Program,
    aliases,
    capture_program,
    changed_since,
    known_int,
    may_copy,
    storage,
    tensor_spec,
    unreachable,
)
from adapters.torchnames import OP_LIBRARIES, SOURCE_FNS, dtype_name, dtype_of, resolve_target, target_name
from adapters.weights import in_float64, materialize, plain_torch, quantized_values
from fxpure.layout import CODE as LAYOUT_READER
from fxpure.layout import passes_strides
from fxpure.plan import (
    NewNode,
    Rejection,
    RewritePlan,
    RewriteReport,
    Rule,
    check_rules,
    constant_expr,
    no_cyclic_gc,
    planned_on,
    read_spans,
    shown,
    specs_differ,
)
from fxpure.reasons import Declined, NonFinite, PlanConflict, Reason
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, Opaque, TensorSpec, ref_list, refs
from fxpure.weights import (
    FLOAT_DTYPES,
    INT_RANGES,
    Binary,
    Cast,
    MatMul,
    Quantize,
    Source,
    SumOver,
    Unary,
    WeightExpr,
    Within,
    children,
    infer_spec,
    moves_data,
    source_exprs,
    sources,
    subexpressions,
)

V = TypeVar("V")

# meta a new node inherits from the node it was planned from
INHERITED_META = (
    "nn_module_stack",
    "stack_trace",
    "source_fn_stack",
    "torch_fn",
    "from_node",
    "seq_nr",
    "debug_handle",
)


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
    """Internal: a reason to abort, with nothing left changed."""

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
    vals: dict[tuple[TensorSpec, bool], Any] = field(default_factory=dict)
    _symbols: dict[str, Any] | None = None
    sized_mode: Any = None  # the fake mode of :meth:`sized` values, made when first needed

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

    def sized(self, value: Any) -> Any:
        """``value`` at the sizes the program was exported at (each symbol's hint): a fake tensor of
        them, in a fake mode without a shape environment, so that running it adds no guard to the
        program's symbols; a symbolic int becomes its hint. None where a size has no hint (a
        data-dependent one)."""
        if self.sized_mode is None:
            self.sized_mode = FakeTensorMode()
        if isinstance(value, (tuple, list)):
            out = [self.sized(v) for v in value]
            return None if any(o is None for o, v in zip(out, value, strict=True) if v is not None) else out
        if isinstance(value, torch.SymInt):
            return symbolic_shapes.guarding_hint_or_throw(value) if symbolic_shapes.has_guarding_hint(value) else None
        if isinstance(value, (torch.SymFloat, torch.SymBool)):
            return None
        if not isinstance(value, torch.Tensor) or getattr(value, "fake_mode", None) is self.sized_mode:
            return value
        sizes = [self.sized(d) for d in (*value.shape, *value.stride())]
        if any(d is None for d in sizes):
            return None
        with self.sized_mode:
            return torch.empty_strided(sizes[: value.dim()], sizes[value.dim() :], dtype=value.dtype)

    def value(self, spec: TensorSpec, *, grad: bool = False) -> Any:
        """A contiguous fake tensor of ``spec`` from the graph's own fake mode, shared per spec;
        ``grad``: one that requires grad, as a parameter's value does."""
        if self.mode is None:
            return None
        if (spec, grad) not in self.vals:
            symbols = {} if spec.is_static else self.symbols()
            shape = [d if isinstance(d, int) else symbols[d] for d in spec.shape]
            with self.mode:
                self.vals[spec, grad] = torch.empty(shape, dtype=dtype_of(spec.dtype), requires_grad=grad)
        return self.vals[spec, grad]


def _source_fn_stack(name: str, fn_name: str, source: torch.fx.Node, same_op: bool) -> list[tuple[str, Any]]:
    """The provenance's stack with the last frame naming this node and its own function.

    A node of the same op keeps the provenance's function (e.g. the ``nn.Conv2d`` class)
    so a quantizer partitions each new conv on its own, exactly as for hand-written code.
    """
    stack = list(source.meta.get("source_fn_stack") or [("", None)])
    fn = stack[-1][1] if same_op and stack[-1][1] is not None else SOURCE_FNS.get(fn_name)
    return [*stack[:-1], (name, fn)]


# the opaque literals a new node may copy from a matched one that fxpure writes back: memory
# formats (a clone's, a copy's) and the strided layout, by the text capture recorded them as
_REBUILT: Mapping[str, Any] = {
    repr(v): v
    for v in (
        torch.contiguous_format,
        torch.preserve_format,
        torch.channels_last,
        torch.channels_last_3d,
        torch.strided,
    )
}


def _literal(arg: Arg) -> Any:
    """A literal argument in FX form (node references are resolved when the node is created)."""
    if isinstance(arg, tuple):
        return [_literal(a) for a in arg]
    if isinstance(arg, DTypeArg):
        return dtype_of(arg.name)
    if isinstance(arg, Opaque):
        if arg.text not in _REBUILT:
            raise _ApplyError("unsupported-argument", f"cannot rebuild literal {arg.text}")
        return _REBUILT[arg.text]
    return arg


def _opaque(arg: object) -> Opaque | None:
    """The first literal in an argument tree that :func:`_literal` cannot write back, if any."""
    if isinstance(arg, Opaque):
        return None if arg.text in _REBUILT else arg
    if isinstance(arg, tuple):
        return next((o for a in arg if (o := _opaque(a)) is not None), None)
    return None


def _bind(arg: Any, env: Mapping[str, torch.fx.Node]) -> Any:
    """Node references (``NodeRef``) in a prepared argument replaced by live nodes."""
    if isinstance(arg, NodeRef):
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_bind(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _bind(v, env) for k, v in arg.items()}
    return arg


@final
@dataclass(frozen=True, slots=True)
class _NewNode:
    """A node to insert, prepared: everything but its position-dependent arguments resolved."""

    rec: NodeSnapshot
    op: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    meta: dict[str, Any]
    before: str  # the existing node it goes in front of


@dataclass
class _Edit:
    """The whole change, prepared without touching the program."""

    new: list[_NewNode] = field(default_factory=list)
    changed: list[NodeSnapshot] = field(default_factory=list)
    erased: list[str] = field(default_factory=list)  # in topological order
    env: dict[str, torch.fx.Node] = field(default_factory=dict)  # live nodes by name


def _prepare(cap: Captured, after: GraphSnapshot, tensors: Mapping[str, torch.Tensor]) -> _Edit:
    """Resolve every new node's op, literals, meta and fake value; list the changed and erased nodes.
    Raises _ApplyError; touches nothing."""
    before, edit, fakes = cap.snap, _Edit(), _Fakes.of(cap.gm)
    edit.env = {n.name: n for n in cap.gm.graph.nodes}
    nxt = ""
    for rec in reversed(after.nodes):  # the existing node that follows each new node
        if rec.name in before.index:
            nxt = rec.name
            if before.node(rec.name) is not rec:
                edit.changed.append(rec)
        else:
            edit.new.append(_prepare_new(rec, after, tensors, fakes, edit.env, nxt))
    edit.new.reverse()
    edit.changed.reverse()
    edit.erased = [n.name for n in before.nodes if n.name not in after.index]
    _lay_out(edit, fakes, after.dialect)
    _within_module_runs(edit, after, before)
    return edit


_STACK = "nn_module_stack"


def _within_module_runs(edit: _Edit, after: GraphSnapshot, before: GraphSnapshot) -> None:
    """A new node placed inside the run of nodes one module call computes (the node before it, new
    or existing, and the existing node after it share the module stack ``C``, or its start) that
    stands for a node of another module is taken for part of that call: its module stack becomes
    ``C``. Otherwise the call would be cut in two, and ``torch.export.unflatten`` would call the
    module twice, with the wrong inputs (a merge of two linears of one input, after decompositions,
    placed between the first linear's nodes: it returned a tensor of the wrong shape; or the second
    linear's part placed after the first's, before the first module's next node: it raised). One of
    ``C``'s own submodules keeps its stack."""
    new_by_name = {new.rec.name: new for new in edit.new if new.op == "call_function" and _STACK in new.meta}
    if not new_by_name:
        return
    stacks: list[list[tuple[object, object]] | None] = []
    for rec in after.nodes:  # each existing node's stack, in the final order
        node = edit.env.get(rec.name) if rec.name in before.index and rec.name not in new_by_name else None
        stack = node.meta.get(_STACK) if node is not None and node.op == "call_function" else None
        stacks.append(list(stack.items()) if isinstance(stack, dict) else None)
    nxt: list[list[tuple[object, object]] | None] = []  # the stack of the existing node after each place
    last: list[tuple[object, object]] | None = None
    for stack in reversed(stacks):
        nxt.append(last)
        last = stack if stack is not None else last
    nxt.reverse()
    last = None  # ...and of the node before it, new or existing
    for i, rec in enumerate(after.nodes):
        new = new_by_name.get(rec.name)
        if new is None:
            last = stacks[i] if stacks[i] is not None else last
            continue
        own, later = new.meta[_STACK], nxt[i]
        if not isinstance(own, dict):
            continue
        if last is not None and later is not None:
            n = next((k for k, (a, b) in enumerate(zip(last, later, strict=False)) if a != b), None)
            common = last[: min(len(last), len(later)) if n is None else n]
            if common and list(own.items())[: len(common)] != common:
                own = new.meta[_STACK] = dict(common)
        last = list(own.items())


def _lay_out(edit: _Edit, fakes: _Fakes, dialect: str) -> None:
    """Each new 4-D node reading a channels-last value (a conv fused on a channels-last input), or
    asking for a layout (a copy to channels last a plan keeps after a fold, ``memory_format`` or
    ``dim_order``), is given a fake value laid out as torch computes it, not the contiguous one its
    spec alone makes: ExecuTorch takes a value's dim order from it (an XNNPACK ``.pte`` read a
    channels-last copy as contiguous, 0.8 of its output off), and a later transform judges layouts
    by it (a second transform split the grouped conv after a fused one as if its input were
    contiguous, and the ``.pte`` failed). An aten view stays contiguous (``to_edge`` makes it a
    copy), as does a value torch cannot say of."""
    env: dict[str, Any] = {name: n.meta.get("val") for name, n in edit.env.items()}
    runs: dict[Hashable, tuple[Any, str | None]] = {}
    last: dict[int, bool] = {}  # (fake values are shared: one per spec)
    for new in edit.new:
        val = new.meta.get("val")
        if (
            new.op == "call_function"
            and isinstance(val, torch.Tensor)
            and val.dim() == 4
            and (_reads_channels_last(new, env, last) or not _LAYOUT_ARGS.isdisjoint(new.rec.kwargs))
            and (dialect == "edge" or not _copied(new.target))
            and _channels_last(_ran(fakes, new.rec, dialect, env, set(), runs)[0])
        ):
            with fakes.mode:
                val = new.meta["val"] = torch.empty(
                    val.shape, dtype=val.dtype, requires_grad=val.requires_grad, memory_format=torch.channels_last
                )
        env[new.rec.name] = val


_LAYOUT_ARGS = frozenset({"memory_format", "dim_order"})


def _reads_channels_last(new: _NewNode, env: Mapping[str, Any], last: dict[int, bool]) -> bool:
    """``new`` reads a value laid out channels last (``last``: each value's answer, by identity)."""
    for r in refs((*new.rec.args, *new.rec.kwargs.values())):
        v = env.get(r)
        if id(v) not in last:
            last[id(v)] = _channels_last(v)
        if last[id(v)]:
            return True
    return False


def _prepare_new(
    rec: NodeSnapshot,
    after: GraphSnapshot,
    tensors: Mapping[str, torch.Tensor],
    fakes: _Fakes,
    live: Mapping[str, torch.fx.Node],
    before: str,
) -> _NewNode:
    spec = rec.spec
    val: Any = None
    specs = spec if isinstance(spec, tuple) else (spec,)
    sizes = {d for s in specs if isinstance(s, TensorSpec) and not s.is_static for d in s.shape if isinstance(d, str)}
    unknown = sorted(sizes - fakes.symbols().keys()) if fakes.mode is not None else []
    if unknown:  # a bare list of plans made on another program (one exported with dynamic sizes)
        detail = f"new value {rec.name} has the size {unknown[0]}, which no value of this program has"
        raise _ApplyError("plan-conflict", f"{detail} (were its plans made on another program?)")
    if isinstance(spec, TensorSpec):
        # a new parameter's value requires grad as its tensor does: torch's fake conv picks a
        # backend by that, and for a weight of no grad guards the batch size (a dynamic batch was
        # capped at 15 when the program was traced again)
        val = fakes.value(spec, grad=bool(getattr(tensors.get(rec.name), "requires_grad", False)))
    elif isinstance(spec, tuple):
        val = tuple(fakes.value(s) if s is not None else None for s in spec)
    if rec.name in tensors:  # a new constant: a lifted placeholder or a get_attr
        op = "placeholder" if after.lifted else "get_attr"
        return _NewNode(rec, op, rec.name, (), {}, {"val": val} if val is not None else {}, before)
    try:
        target = resolve_target(rec.target, after.dialect)
    except ValueError as e:
        raise _ApplyError("unknown-op", str(e)) from e
    meta: dict[str, Any] = {}
    source = live.get(rec.provenance) if rec.provenance else None
    if source is not None:
        same_op = source.target == target
        meta.update({k: source.meta[k] for k in INHERITED_META if k in source.meta and (same_op or k != "torch_fn")})
        if rec.source_fn is not None:
            meta["source_fn_stack"] = _source_fn_stack(rec.name, rec.source_fn, source, same_op)
    if val is not None:
        meta["val"] = val
    args = tuple(_literal(a) for a in rec.args)
    kwargs = {k: _literal(v) for k, v in rec.kwargs.items()}
    return _NewNode(rec, "call_function", target, args, kwargs, meta, before)


def _rebuild(old: Any, arg: Arg, env: Mapping[str, torch.fx.Node]) -> Any:
    """An existing node's argument with node references re-pointed as the snapshot says."""
    if isinstance(arg, NodeRef):
        return env[arg.name]
    if isinstance(old, (list, tuple)) and isinstance(arg, tuple) and len(old) == len(arg):
        return type(old)(_rebuild(o, a, env) for o, a in zip(old, arg, strict=True))
    if isinstance(old, torch.fx.Node):
        if old.op == "call_function" and type(arg) is int and known_int(old.meta.get("val")) == arg:
            return old  # a size the snapshot holds as its number (export found it constant)
        raise _ApplyError("apply-failed", f"argument {old.name} has no counterpart in the plan")
    return old


@dataclass
class _Commit:
    """The mutations of one apply, each with its undo, run in order."""

    undo: list[Callable[[], object]] = field(default_factory=list)
    ordered: set[int] = field(default_factory=set)  # the dicts whose order undo restores
    reorder: list[Callable[[], None]] = field(default_factory=list)  # run after every undo

    def keep_order(self, d: dict[Any, Any]) -> None:
        """Undo puts ``d``'s keys back in their order before its first change, last of all (undoing a
        change puts its key back at the end): a module's tensors, a node's users."""
        if id(d) in self.ordered:
            return
        self.ordered.add(id(d))
        order = list(d)

        def undo() -> None:
            rest = dict(d)
            d.clear()
            d.update({k: rest.pop(k) for k in order if k in rest})
            d.update(rest)

        self.reorder.append(undo)

    def keep_names(self, graph: torch.fx.Graph) -> None:
        """Undo gives ``graph``'s namespace back the names it held (torch.fx keeps the name of an
        erased node taken, and the node with it): a node made later is named as it would have been."""
        ns = graph._graph_namespace
        names, used, counts = ns._obj_to_name.copy(), ns._used_names.copy(), ns._base_count.copy()

        def undo() -> None:
            ns._obj_to_name, ns._used_names, ns._base_count = names, used, counts

        self.reorder.append(undo)

    def set_item(self, d: dict[str, V], key: str, value: V) -> None:
        self.del_item(d, key)

        def undo() -> None:
            d.pop(key, None)

        self.undo.append(undo)
        d[key] = value

    def del_item(self, d: dict[str, V], key: str) -> None:
        if key not in d:
            return
        self.keep_order(d)
        old = d[key]
        self.undo.append(lambda: d.__setitem__(key, old))
        del d[key]

    def set_list(self, lst: list[Any], items: list[Any]) -> None:
        old = list(lst)
        self.undo.append(lambda: lst.__setitem__(slice(None), old))
        lst[:] = items

    def set_attr(self, obj: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
        """Set (or, with None, delete) a module tensor: a tensor that is no parameter as a buffer, so
        the module's ``state_dict`` and ``.to()`` reach it; undo restores it as it was: parameter or
        buffer, persistent or not, at its place among the module's tensors."""
        table = next((t for t in (obj._parameters, obj._buffers) if name in t), None)
        had, old = hasattr(obj, name), getattr(obj, name, None)
        transient = name in obj._non_persistent_buffers_set
        if table is not None:
            self.keep_order(table)

        def undo() -> None:
            if hasattr(obj, name):
                delattr(obj, name)
            if table is not None:
                table[name] = old
                if transient:
                    obj._non_persistent_buffers_set.add(name)
            elif had:
                setattr(obj, name, old)

        self.undo.append(undo)  # before the change, which may not finish
        if value is None:
            delattr(obj, name)
        elif isinstance(value, torch.nn.Parameter):
            setattr(obj, name, value)
        else:
            obj.register_buffer(name, value)

    def insert(self, graph: torch.fx.Graph, new: _NewNode, env: dict[str, torch.fx.Node]) -> None:
        at = env[new.before]
        prev, length = at.prev, graph._len
        args, kwargs = _bind(new.args, env), _bind(new.kwargs, env)
        reads: list[torch.fx.Node] = []
        torch.fx.node.map_arg((args, kwargs), reads.append)

        def undo() -> None:  # the node just before ``at`` is this one, if it was linked
            env.pop(new.rec.name, None)
            made = at.prev if at.prev is not prev else None
            if made is not None:
                table = graph._find_nodes_lookup_table
                if made not in table:  # linked, and stopped before the table had it
                    table.insert(made)
                graph.erase_node(made)
            graph._len = length  # (linked, and stopped before it was counted)
            # torch.fx makes a node a user of what it reads before it links it (and runs the module's
            # create-node hooks in between): one that stopped there is a user never linked (its own
            # neighbour in the node list)
            for a in reads:
                for u in [u for u in a.users if u._prev is u]:
                    del a.users[u]

        self.undo.append(undo)  # before the change, which may not finish
        with graph.inserting_before(at):
            node = graph.create_node(new.op, new.target, args, kwargs, name=new.rec.name)
        # FX renames a name that shadows a builtin ("input"): keep the snapshot's (only then: a rename
        # updates the graph's lookup table)
        if node.name != new.rec.name:
            node.name = new.rec.name
        node.meta.update(new.meta)
        env[new.rec.name] = node

    def reargue(self, node: torch.fx.Node, rec: NodeSnapshot, env: Mapping[str, torch.fx.Node]) -> None:
        args = tuple(_rebuild(o, a, env) for o, a in zip(node.args, rec.args, strict=True))
        kwargs = {k: _rebuild(node.kwargs[k], a, env) for k, a in rec.kwargs.items()}
        old_args, old_kwargs = node.args, node.kwargs
        for read in node.all_input_nodes:  # (set back, the node would be their last user)
            self.keep_order(read.users)

        def undo() -> None:
            node.args, node.kwargs = old_args, old_kwargs

        self.undo.append(undo)  # before the change: setting args and kwargs is two steps
        node.args, node.kwargs = args, kwargs

    def erase(self, graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        if node.users:
            raise _ApplyError("apply-failed", f"{node.name} is still read by {next(iter(node.users)).name}")
        following, args, kwargs, length = node.next, node.args, node.kwargs, graph._len
        for read in node.all_input_nodes:
            self.keep_order(read.users)

        def undo() -> None:  # put the very node back where it was (torch.fx has no public undo), from
            # wherever erase_node stopped: an interrupt may stop it half way
            if following._prev is not node:
                following._prepend(node)
            node._erased = False
            graph._len = length
            node.args, node.kwargs = args, kwargs

        self.undo.append(undo)  # before the erase, which may not return
        graph.erase_node(node)

    def rollback(self, gm: torch.fx.GraphModule) -> BaseException | None:
        """Run every undo, the last change's first, each also where one before it failed, with the
        module's node hooks detached (one that raises would stop the rollback; it is no edit of the
        program's to observe); then give every node back its place in the graph's lookup table,
        which torch.fx leaves a node out of when it is stopped setting a field of it (by a Ctrl-C in
        ``recompile``, say). Returns the first failure of an undo (a Ctrl-C rather than any other):
        the program may then be changed."""
        hooks = {name: getattr(gm, name) for name in _NODE_HOOKS if getattr(gm, name, None)}
        failed: BaseException | None = None
        try:
            # (the hooks detached as steps too: a Ctrl-C there stops no undo; as plain attributes,
            # in the module's __dict__, put back in one call: a Ctrl-C cannot land half way)
            steps: list[Callable[[], object]] = [functools.partial(gm.__dict__.__setitem__, n, []) for n in hooks]
            steps += [*reversed(self.undo), *self.reorder, functools.partial(_mend_lookup, gm.graph)]
            for fn in steps:
                try:
                    fn()
                except BaseException as e:  # the others still run: the closer to as it was, the better
                    # (the first failure is told, a Ctrl-C before any: it is raised when all have run)
                    if failed is None or (isinstance(failed, Exception) and not isinstance(e, Exception)):
                        failed = e
        finally:
            gm.__dict__.update(hooks)
            self.undo.clear()
            self.reorder.clear()
        return failed


def _mend_lookup(graph: torch.fx.Graph) -> None:
    """Put back in ``graph``'s lookup table (``find_nodes``) each node torch.fx left out of it."""
    table = graph._find_nodes_lookup_table
    for node in graph.nodes:
        if node not in table:
            table.insert(node)


# the callbacks a GraphModule runs on its graph's edits (``_register_erase_node_hook``)
_NODE_HOOKS = ("_create_node_hooks", "_erase_node_hooks", "_replace_hooks")


def _owner(gm: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    prefix, _, leaf = path.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), leaf


_INPUT_KINDS: Mapping[str, InputKind] = {
    "parameter": InputKind.PARAMETER,
    "buffer": InputKind.BUFFER,
    "constant": InputKind.CONSTANT_TENSOR,
}


def _input_spec(name: str, kind: str, key: str) -> InputSpec:
    persistent = True if kind == "buffer" else None
    return InputSpec(_INPUT_KINDS[kind], TensorArgument(name=name), key, persistent=persistent)


def _commit_ep(
    c: _Commit, cap: Captured, ep: ExportedProgram, new: Mapping[str, torch.Tensor], after: GraphSnapshot
) -> None:
    sig = ep.graph_signature
    # a new constant goes under the module of what it reads, unless that module's call signature is
    # preserved (a module swapped in for it would not hold it): then at the root, by its node's name
    preserved = tuple(f"{e.fqn}." for e in ep.module_call_graph if e.fqn and e.signature is not None)
    keys = {k: k if after.constants[k].key.startswith(preserved) else after.constants[k].key for k in new}
    specs = [
        cap.specs.get(n.name) or _input_spec(n.name, after.constants[n.name].kind, keys.get(n.name, n.name))
        for n in cap.gm.graph.find_nodes(op="placeholder")
    ]
    live = {s.target for s in specs}
    gone = {t: None for t in (s.target for s in cap.specs.values()) if t is not None and t not in live}
    # a strict export keeps state no spec names (a tied weight's second key, a module forward never
    # calls, num_batches_tracked): it goes, unless it is a tensor a spec still names (a tied key)
    held = {
        storage(d[t]) for t in live for d in (ep.state_dict, ep.constants) if t in d and isinstance(d[t], torch.Tensor)
    }
    gone |= {
        k: None
        for d in (ep.state_dict, ep.constants)
        for k, t in d.items()
        if k not in live and k not in gone and not (isinstance(t, torch.Tensor) and storage(t) in held)
    }
    for target in gone:
        c.del_item(ep.state_dict, target)
        c.del_item(ep.constants, target)
    for name, t in new.items():
        c.set_item(ep.constants if after.constants[name].kind == "constant" else ep.state_dict, keys[name], t)
    result = cap.gm.graph.output_node().args[0]
    values = list(result) if isinstance(result, (list, tuple)) else [result]
    # outputs that are None or Python constants have no node: their specs stay as they are
    out_specs = [
        OutputSpec(s.kind, TensorArgument(name=v.name), s.target)
        if isinstance(s.arg, TensorArgument) and isinstance(v, torch.fx.Node)
        else s
        for s, v in zip(sig.output_specs, values, strict=True)
    ]
    c.set_list(sig.input_specs, specs)
    c.set_list(sig.output_specs, out_specs)


def _commit_gm(c: _Commit, cap: Captured, after: GraphSnapshot, new: Mapping[str, torch.Tensor]) -> None:
    live = {after.node(k).target for k in after.constants if after.node(k).op == "get_attr"}
    # what the graph still reads as a whole: a called module (its parameters with it), an attribute
    held = tuple(f"{n.target}." for n in after.nodes if n.op in ("call_module", "get_attr"))
    for name in cap.snap.constants:
        node = cap.snap.node(name)
        dead = node.op == "get_attr" and node.target not in live and not node.target.startswith(held)
        if dead and _attr_exists(cap.gm, node.target):
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


def _edit_graph(c: _Commit, cap: Captured, edit: _Edit) -> None:
    graph, env = cap.gm.graph, edit.env
    for new in edit.new:
        c.insert(graph, new, env)
    for rec in edit.changed:
        c.reargue(env[rec.name], rec, env)
    for name in reversed(edit.erased):
        c.erase(graph, env[name])


def _run_ahead(edit: _Edit) -> None:
    """Run each new conv of symbolic sizes once in the program's own fake mode, its guards
    suppressed. torch's fake conv picks a kernel by the batch size (``size(0) >= 16``) and guards
    it the first time a pass runs the conv: ``to_executorch`` runs every node again, and a dynamic
    batch was capped at 15 in the lowered program (after fuse-conv-bn, split-group-conv,
    conv1d-to-conv2d or linear-to-conv2d). Run here on values like those such a pass computes
    (requiring grad where a parameter they are computed from does), the result is in torch's
    fake-tensor cache, which that pass reads, as it reads the original convs' (run when the
    program was exported). Best effort: what cannot run here is left to that pass."""
    grads: dict[torch.fx.Node, bool] = {}

    def grad(node: torch.fx.Node) -> bool:  # as autograd would have it: a float computed from one that does
        # (an exported activation's value records no grad, but the pass computes it from parameters);
        # found for the whole graph, in order, the first time it is asked
        for n in node.graph.nodes if not grads else ():
            v = n.meta.get("val")
            computed = n.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point()
            grads[n] = bool(getattr(v, "requires_grad", False)) or (
                computed and any(grads.get(a, False) for a in n.all_input_nodes)
            )
        return grads.get(node, False)

    def val(a: Any) -> Any:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if not isinstance(a, torch.fx.Node) or not isinstance(v, torch.Tensor) or v.requires_grad or not grad(a):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device, requires_grad=True)

    for new in edit.new:
        node = edit.env.get(new.rec.name)
        if new.rec.target not in fxpure.families.CONV.targets or node is None:
            continue
        x: Any = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        mode = getattr(x, "fake_mode", None)
        env = getattr(mode, "shape_env", None)
        if mode is None or env is None or not any(isinstance(d, torch.SymInt) for d in x.shape):
            continue
        target: Any = node.target
        with contextlib.suppress(Exception), mode, env.suppress_guards():
            target(*torch.fx.node.map_aggregate(node.args, val), **torch.fx.node.map_aggregate(node.kwargs, val))


def realize(
    cap: Captured, after: GraphSnapshot, new: dict[str, torch.Tensor]
) -> tuple[tuple[str, ...], tuple[str, ...], int, int]:
    """Make the live program match ``after`` (its new constants computed: ``new``), in place; raises
    _ApplyError, or re-raises a BaseException, with the program exactly as it was."""
    try:
        edit = _prepare(cap, after, new)
        # (all found before the commit: nothing after it can fail with the program changed)
        kept = {k: v for k, v in cap.tensors.items() if k in after.constants}
        added = tuple(n.rec.name for n in edit.new if n.rec.name in new)
        dropped = tuple(n for n in edit.erased if n in cap.snap.constants)
        found = added, dropped, _bytes(cap.tensors), _bytes({**kept, **new})
    except _ApplyError:
        raise
    except Exception as e:  # preparing must not fail; if torch does, nothing was touched
        raise _ApplyError("apply-failed", f"{type(e).__name__}: {e}") from e
    c = _Commit()
    try:
        c.undo.append(cap.gm.recompile)  # (last of all: the graph as it was, its code with it)
        c.keep_names(cap.gm.graph)
        _edit_graph(c, cap, edit)
        if isinstance(cap.program, ExportedProgram):
            _commit_ep(c, cap, cap.program, new, after)
        else:
            _commit_gm(c, cap, after, new)
        cap.gm.recompile()
        _run_ahead(edit)  # (inside: a Ctrl-C there rolls back too)
    except BaseException as e:  # every exit rolls back, Ctrl-C included
        failed = c.rollback(cap.gm)
        undone = (
            "was rolled back"
            if failed is None
            else f"could not be rolled back ({type(failed).__name__}: {failed}): the program may be changed"
        )
        if failed is not None and not isinstance(failed, Exception):  # a Ctrl-C in the rollback, once it is done
            failed.add_note(f"fxpure: a commit that failed ({type(e).__name__}: {e}) {undone}")
            raise failed from e
        if not isinstance(e, Exception):
            if failed is not None:
                e.add_note(f"fxpure: {undone}")
            raise
        code = e.code if isinstance(e, _ApplyError) else "apply-failed"
        raise _ApplyError(code, f"commit failed and {undone}: {type(e).__name__}: {e}") from e
    return found


def _bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors.values():
        if not t.is_meta:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _materialize_new(cap: Captured, after: GraphSnapshot, memo: dict[object, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new constants of ``after``, computed; _ApplyError where torch fails (nothing was touched)."""
    try:
        return _each_new(cap, after, memo)
    except _ApplyError:
        raise
    except Exception as e:  # (a torch error outside a constant's own computation: the Parameter made of it)
        raise _ApplyError("materialize-failed", f"{type(e).__name__}: {e}") from e


def _each_new(cap: Captured, after: GraphSnapshot, memo: dict[object, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    # (or fake: a program exported under FakeTensorMode holds no data either)
    on_meta = {k for k, t in cap.tensors.items() if t.is_meta or isinstance(t, FakeTensor)}
    # in graph order: the constants map's own order follows string hashes, which change per process
    derived = sorted((k for k, i in after.constants.items() if i.source is not None), key=after.index.__getitem__)
    for name in derived:
        info = after.constants[name]
        source = info.source
        assert source is not None  # derived, as sorted above
        meta = sorted(k for k in sources(source) if k in on_meta) if on_meta else []
        if meta:
            raise _ApplyError(
                "meta-tensor",
                f"{cap.snap.constants[meta[0]].key} is on the meta device (or fake): there is no data to compute"
                f" {name} from"
                " (load the weights first, or plan with dry_run=True)",
            )
        try:
            t = materialize(source, cap.tensors, memo)
        except Exception as e:  # a torch error while computing a constant: abort cleanly
            raise _ApplyError("materialize-failed", f"{name}: {e}") from e
        got = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        if got != (info.spec.shape, info.spec.dtype):
            raise _ApplyError("materialize-failed", f"{name}: computed {got}, planned {info.spec}")
        if info.kind == "parameter":  # requiring grad where a parameter it is computed from does
            # (an integer one cannot)
            grad = (t.is_floating_point() or t.is_complex()) and any(
                getattr(cap.tensors.get(k), "requires_grad", False) for k in sources(source)
            )
            t = torch.nn.Parameter(t, requires_grad=grad)
        out[name] = t
    return out


def _non_finite(
    new: Mapping[str, torch.Tensor], after: GraphSnapshot, tensors: Mapping[str, torch.Tensor]
) -> list[str]:
    """Derived floating constants holding inf or NaN that their computation brings in (a fold that
    overflowed its dtype, say). Where a constant it reads holds some already and the expression only
    moves data (a slice of a weight with an inf: the new op reads the inf the old one read), it is
    computed again with those made 1, and counts only if still not finite; arithmetic on an inf
    counts (``W * inf`` in a fold: the old op scaled its finite sum, the new one sums infinities of
    both signs, NaN), also where the result is of an integer dtype (a quantized copy of it)."""

    def finite(t: torch.Tensor) -> bool:
        return not t.is_floating_point() or bool(torch.isfinite(t).all())

    out = []
    for k, t in new.items():
        source = after.constants[k].source
        if source is None or (finite(t) and t.is_floating_point()):
            continue
        read = {key: tensors[key] for key in sources(source) if key in tensors}
        if not t.is_floating_point():  # integers hold no inf: arithmetic on one saturates (a quantize: 127)
            if not all(map(finite, read.values())) and not moves_data(source):
                out.append(k)
            continue
        if not all(map(finite, read.values())) and moves_data(source):
            made_finite = {
                key: v if finite(v) else torch.nan_to_num(v, nan=1.0, posinf=1.0, neginf=1.0) for key, v in read.items()
            }
            t = materialize(source, {**tensors, **made_finite})
        if not finite(t):
            out.append(k)
    return out


_HALF = ("float16", "bfloat16")


# float32 arithmetic that can round a product of normal values into the subnormals, or to zero (a
# sum or a difference that lands there is exact, a square root of a normal value is normal)
_SHRINKS = frozenset({"mul", "div", "reciprocal"})


def _rounded(e: WeightExpr, low: Collection[WeightExpr]) -> bool:
    """``e`` is a part of a constant's computation whose rounding can lose a value below its dtype's
    smallest normal: a cast to float16 or bfloat16, or float32 arithmetic holding such a value
    (``low``, :func:`_low`: ``w * 1e-31``)."""
    return (isinstance(e, Cast) and e.dtype in _HALF) or e in low


def _computed_at(snap: GraphSnapshot, p: RewritePlan, dtypes: Collection[str] | None = None) -> set[WeightExpr]:
    """The constant values the program computes at the nodes ``p`` removes (of ``dtypes`` only, if
    given): what the program read there."""
    out = set()
    for name in {*p.prune, *p.erase}:
        spec = snap.node(name).tensor_spec
        if dtypes is None or (spec is not None and spec.dtype in dtypes):
            e = constant_expr(snap, name)
            if e is not None:
                out.add(e)
    return out


def _own_parts(report: RewriteReport) -> list[tuple[frozenset[WeightExpr], frozenset[WeightExpr]]]:
    """Per plan, the expressions of its constants, and the floating values the program itself
    computes in them (``w.half()``, or ``w * 1e-31``, in ``forward``): what their rounding loses,
    eager lost too. Found at the nodes the plan removes, which compute the constants it reads."""
    return [
        (frozenset(c.expr for c in p.constants), frozenset(_computed_at(snap, p, (*_HALF, "float32", "float64"))))
        for snap, plans in planned_on(report)
        for p in plans
    ]


def _computed_ahead(report: RewriteReport) -> frozenset[WeightExpr]:
    """The new constants a plan made that are values the program computes itself, at a node the
    plan removes (constant folding: a causal mask's ``-inf`` computed from a buffer in ``forward``,
    or ``(var - var).rsqrt()``): the program read that value where it now reads the constant."""
    out: set[WeightExpr] = set()
    for snap, plans in planned_on(report):
        for p in plans:
            out |= _computed_at(snap, p) & {c.expr for c in p.constants}
    return frozenset(out)


# elements of float32 values :func:`_low` stacks at most (16 MB): a model repeats its blocks, and
# one look at many is cheaper than one at each, but not at the cost of a copy of every weight at once
_STACKED = 1 << 22


def _low(memo: Mapping[object, torch.Tensor], value: Callable[[WeightExpr], torch.Tensor]) -> set[WeightExpr]:
    """The float32 products, quotients and reciprocals among the parts of the constants computed
    (each in ``memo``) that hold a value below float32's smallest normal: a subnormal, or a zero of
    operands that are not (a factor below 1e-45 flushes a weight whole; a batch norm's mean of 0
    times its scale is exact), or, for a matrix product, a zero where the product in float64 holds
    none (two linears of 1e-20 and 1e-26 merged). Elementwise ones are looked at in stacks of one op
    and shape (most folds have none)."""
    same: dict[tuple[str, torch.Size], list[tuple[Binary | Unary, torch.Tensor]]] = {}
    tiny, out = torch.finfo(torch.float32).tiny, set[WeightExpr]()
    for e, t in memo.items():
        if not (isinstance(e, Binary | Unary | MatMul) and t.dtype is torch.float32 and t.numel()):
            continue
        if isinstance(e, MatMul):
            if _low_product(t, value(e.a), value(e.b), tiny):
                out.add(e)
        elif e.op in _SHRINKS:
            same.setdefault((e.op, t.shape), []).append((e, t))
    for (op, shape), parts in same.items():
        step = max(1, _STACKED // parts[0][1].numel())
        for chunk in (parts[i : i + step] for i in range(0, len(parts), step)):
            values = torch.stack([t for _, t in chunk]) if len(chunk) > 1 else chunk[0][1].unsqueeze(0)
            size = values.abs()
            if float(size.amin()) >= tiny:  # (one pass, the usual case)
                continue
            small = size < tiny
            zero = values == 0
            found = (small & ~zero).reshape(len(chunk), -1).any(dim=1)
            out.update(chunk[i][0] for i in found.nonzero().flatten().tolist())
            # the parts holding a zero, and their operands (the reciprocal of a finite float32 is no zero)
            at = zero.reshape(len(chunk), -1).any(dim=1).nonzero().flatten().tolist() if op != "reciprocal" else []
            held = [e for e in (chunk[i][0] for i in at) if isinstance(e, Binary)]
            if held:
                a = torch.stack([_filled(value(e.a), shape) for e in held])
                b = torch.stack([_filled(value(e.b), shape) for e in held])
                flushed = zero[at] & (a != 0) & ((b != 0) if op == "mul" else torch.isfinite(b))
                found = flushed.reshape(len(held), -1).any(dim=1)
                out.update(held[i] for i in found.nonzero().flatten().tolist())
    return out


def _low_product(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tiny: float) -> bool:
    """The float32 matrix product ``t = a @ b`` holds a subnormal, or a zero where the product in
    float64 holds none, or was summed from terms below ``tiny`` (each rounded to the subnormals'
    grid: 65,536 terms of 1.5 * 2**-149 summed to a normal value 0.4% off)."""
    nonzero_a, nonzero_b = a.abs()[a != 0], b.abs()[b != 0]
    if nonzero_a.numel() and nonzero_b.numel() and float(nonzero_a.amin()) * float(nonzero_b.amin()) < tiny:
        return True
    size = t.abs()
    return float(size.amin()) < tiny and (
        bool(((size < tiny) & (t != 0)).any()) or bool(((t == 0) & (torch.matmul(a.double(), b.double()) != 0)).any())
    )


def _filled(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` broadcast to ``shape`` (itself where it has that shape already)."""
    return t if t.shape == shape else t.expand(shape)


def _low64(
    memo: Mapping[object, torch.Tensor], value: Callable[[WeightExpr], torch.Tensor]
) -> dict[WeightExpr, torch.Tensor]:
    """The float64 products (matrix products too), quotients and reciprocals among the parts of the
    constants computed (each in ``memo``) that lost bits below float64's smallest normal, each with
    where: a value rounded on the subnormals' grid, or flushed to 0 (weights of 1e-160 times
    1e-165), against the same computed with its result scaled by 2**500, exactly (a subnormal
    doubled, or a sum that cancels to 0, lost nothing). Nothing wider holds the exact values:
    :func:`_underflows` asks whether the constant feels what they lost."""
    tiny, out = torch.finfo(torch.float64).tiny, dict[WeightExpr, torch.Tensor]()
    for e, t in memo.items():
        if not (
            (isinstance(e, MatMul) or (isinstance(e, Binary | Unary) and e.op in _SHRINKS))
            and t.dtype is torch.float64
            and t.numel()
        ):
            continue
        size = t.abs()
        if float(size.amin()) >= tiny:  # (one pass, the usual case)
            continue
        scaled = _scaled(e, value, t.shape)
        where = (size < tiny) & (t * _SCALE != scaled) & torch.isfinite(scaled)
        if bool(where.any()):
            out[e] = where
    return out


_SCALE = 2.0**500


def _scaled(e: Binary | Unary | MatMul, value: Callable[[WeightExpr], torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """``e`` computed with its result scaled by :data:`_SCALE` (an operand scaled, exactly): where
    ``e`` is below the normals, its value rounded to 53 bits (inf where a scaled operand overflows)."""
    if isinstance(e, MatMul):
        return torch.matmul(value(e.a) * _SCALE, value(e.b))
    if isinstance(e, Unary):  # (a reciprocal)
        return _SCALE / value(e.x)
    a, b = _filled(value(e.a), shape), _filled(value(e.b), shape)
    if e.op == "div":
        return (a * _SCALE) / b
    return torch.where(a.abs() <= b.abs(), (a * _SCALE) * b, a * (b * _SCALE))  # (the smaller one scaled)


def _underflows(
    new: Mapping[str, torch.Tensor],
    report: RewriteReport,
    tensors: Mapping[str, torch.Tensor],
    memo: dict[object, torch.Tensor],
) -> dict[str, tuple[WeightExpr, ...]]:
    """Derived constants computed with a rounding that loses what an output holds, with the parts
    that do, not the program's own (:func:`_own_parts`):

    - a cast to float16 or bfloat16 of a value computed wider (a fold; the constant itself, or what
      a later rule made of it: a slice, a reshape, a concatenation, another fold), judged against
      that value: in some slice along dim 0 (a conv's or a linear's output channel), the values below
      the dtype's smallest normal (a weight times 1e-4 in float16, flushed to 0) err, summed, by
      more than half the dtype's epsilon times the largest slice's sum of magnitudes (each value of
      a vector alone, against the largest), where eager scaled an ordinary sum. One near-dead
      channel among ordinary ones is no loss at the output's scale (a batch norm's gamma of 1e-5:
      its bias carries the channel);
    - float32 arithmetic holding a value below float32's smallest normal (:func:`_low`: a weight
      times 1e-31), judged by the constant it computes against the same constant computed in
      float64 from that part's low values exact (:func:`_drifts`): what the constant does not
      feel (a subnormal running mean next to a batch norm's bias of 0.5) is no loss;
    - float64 arithmetic that lost bits below float64's smallest normal (:func:`_low64`: weights
      of 1e-160 times 1e-165, flushed to 0), where nothing wider computes it exactly: lossy if the
      constant computed with each such value one subnormal step further from 0 differs (by
      :func:`_drifts`): if it feels what their rounding may have lost.

    ``memo``: the one the constants were computed with (their parts are in it)."""

    def value(e: WeightExpr) -> torch.Tensor:
        if isinstance(e, Source):  # (a parameter as data: no autograd, no warning on float() of it)
            return tensors[e.key].detach()
        known = memo.get(e)
        return known if known is not None else materialize(e, tensors, memo)

    below: dict[WeightExpr, tuple[WeightExpr, ...]] = {}

    def rounded(e: WeightExpr) -> tuple[WeightExpr, ...]:  # each shared part walked once
        known = below.get(e)
        if known is None:
            inner = [c for x in children(e) for c in rounded(x)]
            known = below[e] = tuple(dict.fromkeys([*([e] if _rounded(e, low) else []), *inner]))
        return known

    # a float32 program's fold may round through float16 too: the parts are looked for in every
    # value computed (each in ``memo``), and the expressions walked only if there is one
    low, low64, tiny = _low(memo, value), _low64(memo, value), torch.finfo(torch.float32).tiny
    if not low and not low64 and not any(isinstance(e, Cast) and e.dtype in _HALF for e in memo):
        return {}
    low |= low64.keys()  # (a float64 part in float64 is as computed: the float32 judgement passes it)
    after = report.after
    found = {k: (e, rounded(e)) for k in new if (e := after.constants[k].source) is not None}
    parts_of = {k: found for k, found in found.items() if found[1]}
    if not parts_of:
        return {}
    # the program's own values in a constant are those the plans that made it found computed (by
    # their place: an equal expression another plan made of a fold is not the program's)
    plans = _own_parts(report)
    any_own = frozenset().union(*(mine for _, mine in plans))
    verdict: dict[WeightExpr, bool] = {}
    out: dict[str, tuple[WeightExpr, ...]] = {}
    for k, (source, parts) in parts_of.items():
        own: set[WeightExpr] = set()
        if any(c in any_own for c in parts):  # (the walk only where a part may be the program's)
            inside = subexpressions(source)
            own = own.union(*(mine for made, mine in plans if made & inside))

        def given(e: WeightExpr, own: set[WeightExpr] = own) -> torch.Tensor | None:
            # as computed: a source, the program's own, and what holds no low part; a low part
            # in float64 where it holds such a value (its ordinary roundings elsewhere, which eager
            # makes too, are no loss: a bias of beta - mean * scale, close to 0, amplifies them)
            if isinstance(e, Source) or e in own or not any(c in low for c in below[e]):
                return value(e)
            if e in low:
                wide = in_float64(e, lambda x: None if x is e else given(x))  # (a low part in it exact too)
                if isinstance(e, MatMul):  # (summed from low terms, a normal value errs too)
                    return wide
                computed = value(e)
                return torch.where(computed.abs() < tiny, wide, computed.double())
            return None

        lossy: list[WeightExpr] = []
        for c in parts:
            if isinstance(c, Cast) and c not in own:
                if c not in verdict:  # (a cast several constants read, a folded weight's slices: judged once)
                    # a rounding of data the program holds (a number, a weight) torch does too
                    verdict[c] = not moves_data(c.x) and _flushes(value(c), value(c.x))
                if verdict[c]:
                    lossy.append(c)
        arithmetic = [c for c in parts if not isinstance(c, Cast) and c not in own]
        if arithmetic and _drifts(new[k], in_float64(source, given)):
            lossy.extend(arithmetic)
        elif new[k].dtype is torch.float64 and (lost := [c for c in arithmetic if c in low64]):

            def nudged(e: WeightExpr, lost: Collection[object] = lost) -> torch.Tensor | None:
                # each low part's low values one subnormal step further from 0: what rounding may have lost there
                if e in lost:
                    t = value(e)
                    return torch.where(low64[e], t + torch.copysign(torch.tensor(math.ulp(0.0), dtype=t.dtype), t), t)
                return value(e) if isinstance(e, Source) or not any(c in lost for c in below[e]) else None

            if _drifts(new[k], in_float64(source, nudged)):
                lossy.extend(lost)
        if lossy:
            out[k] = tuple(sorted(lossy, key=repr))
    return out


def _drifts(t: torch.Tensor, exact: torch.Tensor) -> bool:
    """``t``, computed as ``exact`` is in float64, errs by more than float32's roundings of a fold
    do: in some slice along dim 0 (each value of a vector alone), by more than 64 times its dtype's
    epsilon times the largest slice's sum of magnitudes."""
    if t.numel() == 0 or not t.is_floating_point():
        return False
    rows = t.reshape(t.shape[0] if t.dim() > 1 else t.numel(), -1).double()
    wide = exact.reshape(rows.shape)
    err = (rows - wide).abs().sum(dim=1)
    return bool((err > 64 * torch.finfo(t.dtype).eps * wide.abs().sum(dim=1).max()).any())


def _flushes(t: torch.Tensor, exact: torch.Tensor) -> bool:
    """``t``, a cast of ``exact``, loses what an output holds (:func:`_underflows`)."""
    if t.numel() == 0 or exact.element_size() <= t.element_size() or not exact.is_floating_point():
        return False
    rows = t.reshape(t.shape[0] if t.dim() > 1 else t.numel(), -1)  # a slice per row
    low = rows.abs() < torch.finfo(t.dtype).tiny
    if not bool(low.any()):  # no zero nor subnormal: nothing underflowed
        return False
    wide, (row, col) = exact.reshape(rows.shape), low.nonzero().unbind(1)
    lost = (wide[row, col] - rows[row, col].to(exact.dtype)).abs()
    if not bool(lost.any()):  # zeros computed as zeros (a pruned channel)
        return False
    # (the error of the other values, rounded as normal ones, is at most half the bound)
    err = torch.zeros(rows.shape[0], dtype=exact.dtype).index_add_(0, row, lost)
    size = torch.linalg.vector_norm(wide, 1, dim=1)
    return bool((err > torch.finfo(t.dtype).eps / 2 * size.max()).any())


def _culprits(
    report: RewriteReport, bad: Sequence[str], flushed: Mapping[str, tuple[WeightExpr, ...]] | None = None
) -> dict[tuple[str, str], Reason]:
    """Every plan that adds a non-finite constant (``bad``) or one that underflows (``flushed``, with
    the casts that do), with the reason. An earlier rule's constant it is computed from is not to
    blame for one not finite: it is checked on its own once the plan is declined. For an underflow,
    the plan whose own constant is a flushing cast is (a fold a later rule sliced or folded again),
    else the one that computes the constant."""
    out: dict[tuple[str, str], Reason] = {}
    flushed = flushed or {}
    for name in (*bad, *flushed):
        info = report.after.constants[name]
        code = "non-finite-weight" if name in bad else "weight-underflow"
        for expr in (*flushed.get(name, ()), info.source):
            found = False
            for p in report.plans:
                local = next((c.name for c in p.constants if c.expr == expr), None)
                if local is not None:  # located as the core locates a plan's constant: by its name in the plan
                    out[(p.rule, p.anchor)] = NonFinite(
                        code=code, node=p.anchor, constant=name, dtype=info.spec.dtype, path=f"plan.{local}"
                    )
                    found = True
            if found:
                break
    return out


def _crossing(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan that removes a node a preserved module call signature names, with the reason: it
    erases or prunes the node, or takes its uses, or (a constant left unread) computes from it.
    Raises _ApplyError if such a node is gone and no plan is to blame."""
    gone = {n: fqn for n, fqn in cap.pinned.items() if n not in report.after.index}
    if not gone:
        return {}
    out: dict[tuple[str, str], Reason] = {}
    for p in report.plans:
        read = {k for c in p.constants for k in sources(c.expr) if k in gone}  # a Source's key is its node
        hit = next((n for n in (*p.erase, *(old for old, _ in p.replace), *p.prune, *sorted(read)) if n in gone), None)
        if hit is not None:
            detail = f"{hit} is an input or output of {gone[hit]!r}, whose call signature the program preserves"
            out[(p.rule, p.anchor)] = Declined(code="preserved-signature", node=p.anchor, detail=detail)
    if not out:
        name, fqn = next(iter(gone.items()))
        raise _ApplyError("preserved-signature", f"{name}, which {fqn!r}'s preserved call signature names, would go")
    return out


def _inside_preserved(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan that adds a constant inside a module whose call signature the program preserves,
    with the reason: the constant would be the program's, so ``torch.export.unflatten`` would pass
    it to the module as an input its signature has not (and swapping the module in would fail)."""
    program = cap.program
    kept = (
        {e.fqn for e in program.module_call_graph if e.fqn and e.signature is not None}
        if isinstance(program, ExportedProgram)
        else set()
    )
    if not kept:
        return {}
    live = {n.name: n for n in cap.gm.graph.nodes}
    out: dict[tuple[str, str], Reason] = {}
    for p in report.plans:
        if not p.constants:
            continue
        # the anchor, and every node the plan stands in for or removes: a merge anchored at an input
        # outside the module may rewrite the linears inside it
        touched = (p.anchor, *(m.provenance for m in p.nodes), *p.erase, *(old for old, _ in p.replace))
        for name in dict.fromkeys(n for n in touched if n in live):
            stack = live[name].meta.get("nn_module_stack", {})
            inside = next((fqn for fqn, _ in stack.values() if fqn in kept), None)
            if inside is not None:
                detail = (
                    f"{'' if name == p.anchor else f'{p.anchor}: '}{name} is inside {inside!r}, whose call"
                    " signature the program preserves: a new weight there would be one more input of it"
                )
                out[(p.rule, p.anchor)] = Declined(code="preserved-signature", node=p.anchor, detail=detail)
                break
    return out


def _returns_aliased(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan moving a program output to a view (an op returning an alias of what it is given, as
    its schema says: ``aten.view``, ``t``, ``alias``), new or of the program, of a tensor the program
    writes in place (the output would hold the written value when the program returns) or holds or
    is given (its caller would get a view of a parameter or of its own input, through which a write
    changes them), or to such a tensor itself (``w * 1`` dropped); a constant the plan adds counts as
    held (a fold of ``W.t() * 2``, or ``t(k)`` of one, which the program returns). The core's
    ``returns_written`` sees the tensors the program writes themselves, not what views alias."""
    dialect = cap.snap.dialect
    moved = (
        _aliased(new, {n.name: n for n in p.nodes}, dialect, {c.name for c in p.constants})
        for p in report.plans
        for _, new in p.replace
    )
    if all(m is None for m in moved):  # every use moves to a value computed anew (no stage made again)
        return {}
    out: dict[tuple[str, str], Reason] = {}
    written = cap.snap.written
    for snap, stage in planned_on(report):
        al: _Aliasing | None = None
        for p in stage:
            made, added = {n.name: n for n in p.nodes}, {c.name for c in p.constants}
            for old, new in p.replace:
                if not any(snap.node(u).op == "output" for u in snap.users.get(old, ()) if u in snap.index):
                    continue
                # (a plan's own names first, as rewrite reads them: a constant may be named as a node is)
                viewed = _aliased(new, made, snap.dialect, added) if new in made else new
                if viewed is None or (viewed not in snap.index and viewed not in added):
                    continue
                root = viewed
                if viewed not in added:
                    al = al or _aliasing(cap, snap)
                    root = al.root.get(viewed, viewed)
                if root in added:
                    how = "holds (a constant the plan adds)"
                elif root not in snap.index:
                    continue
                elif root in written and new in made:
                    how = "writes in place (its value after the write)"
                elif root not in written and snap.node(root).op in ("placeholder", "get_attr"):
                    how = "holds or is given"
                else:  # (the program's own view of a written tensor, or the tensor: the core's, _written_between's)
                    continue
                what = f"{new} itself" if root == new else f"{new}, a view of {root}"
                detail = f"the output {old} would return {what}, which the program {how}"
                out[(p.rule, p.anchor)] = PlanConflict(node=p.anchor, detail=detail)
                break
    return out


def _aliased(name: str, made: Mapping[str, NewNode], dialect: str, added: Collection[str] = ()) -> str | None:
    """The node of the program, or the constant of ``added`` (the plan's, whose names come first),
    that the new node ``name`` is a view of, through other new views (an element of a new
    ``split``'s, too); None if one of them is no view (or an op torch does not have)."""
    while name in made and name not in added:
        node = made[name]
        try:
            target = resolve_target(node.target, dialect)
        except ValueError:
            return None
        # an edge op holds the aten op it stands for
        target = aten if isinstance(aten := getattr(target, "_op", None), torch._ops.OpOverload) else target
        if target is operator.getitem:  # (an element of what it reads: a view where that is a list of views)
            i, arg = 0, "self"
        else:
            returns_alias, args = aliases(target)
            if not returns_alias or not args:
                return None
            i, arg, _ = args[0]
        value = node.args[i] if 0 <= i < len(node.args) else node.kwargs.get(arg)
        if not isinstance(value, NodeRef):
            return None
        name = value.name
    return name


def _written_between(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan after which a read sees another write than before, with the reason: its new
    nodes read a tensor at another point than the nodes it replaces did, with an in-place write to
    that tensor in between (an aten program may hold ``x.mul_(2)``: a conv fused at its batch norm's
    place would read the written ``x``); or the uses it moves go to another tensor that is written
    while they read it, or that they write (``y = z.clone(); y.add_(1)`` with the clone dropped
    would write ``z``); or it removes a write that is read after it (:func:`_lost_writes`)."""
    dialect = cap.snap.dialect
    if not cap.writes and not any(w for p in report.plans for n in p.nodes for _, w, _, _ in _effects(n, dialect)):
        return {}  # nothing is written in place: no stage need be made again
    out: dict[tuple[str, str], Reason] = {}
    for snap, stage in planned_on(report):
        if not stage:
            continue
        al = _aliasing(cap, snap)
        if not al.at:
            continue
        for p in stage:
            hits = [
                f"{w} writes {name} in place between its reads by the matched nodes and the new ones"
                for name, start, stop in read_spans(snap, p)
                for i, w in al.at.get(al.root.get(name, name), ())
                if start <= i < stop
            ]
            hits += _moved_writes(snap, p, al) + _lost_writes(snap, p, al)
            if hits:
                out[(p.rule, p.anchor)] = Declined(code="written-between", node=p.anchor, detail=hits[0])
    return out


def _restrided(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan moving the uses of a value where the program takes a view of it (or of a value
    passing its strides on) that may be a copy (``reshape``, ``flatten``: a view where the strides
    allow, else a copy), and writes in place the tensor that view is of: the replacement may have
    other strides (a linear's 1x1 conv, a slice of merged linears), on which the view may become a
    copy (a write through it lost) or a copy a view (a write reaching it). Fake values cannot tell:
    torch's fake batch norm of a transposed input has other strides than its kernel's result.
    ``layout-sensitive-reader``, with the reason (found by hunts: ``h.reshape(-1, 8).mul_(3)`` after
    a linear made a conv; a conv fused with its batch norm, then made a conv2d)."""
    writers = {root: node for node, root in reversed(cap.writes)}  # each tensor's first writer
    views = [n for n in cap.copies if writers.get(cap.views.get(n, n)) is not None]
    out: dict[tuple[str, str], Reason] = {}
    for snap, stage in planned_on(report) if views else ():
        exposed = _exposed_to_copies(snap, views, writers, cap.views)
        for p in stage:
            why = next((exposed[old] for old, _ in p.replace if old in exposed), None)
            if why is not None:
                out[(p.rule, p.anchor)] = Declined(code=LAYOUT_READER, node=p.anchor, detail=why)
    return out


def _exposed_to_copies(
    snap: GraphSnapshot, views: list[str], writers: dict[str, str], roots: dict[str, str]
) -> dict[str, str]:
    """Each node of ``snap`` whose strides decide whether one of ``views`` (views that may be copies,
    of tensors ``writers`` write) is a view or a copy: the node it reads, and those that node has
    its strides from; with why."""
    exposed: dict[str, str] = {}
    for name in sorted((v for v in views if v in snap.index), key=snap.index.__getitem__):
        node, writer = snap.node(name), writers[roots.get(name, name)]
        for x, _, _, copy in _effects(node, snap.dialect):
            todo = [x] if copy and _read_besides(snap, name, x) else []
            while todo:
                m = snap.node(todo.pop())
                if m.name in exposed:
                    continue
                via = m.name if m.name == x else f"{x} (which has {m.name}'s strides)"
                exposed[m.name] = (
                    f"{name} ({node.target}) reads {via}, and {writer} writes what it views in place: whether"
                    f" {name} is a view or a copy depends on the strides, which a replacement of {m.name} may change"
                )
                if passes_strides(m):
                    todo.extend(ref_list(m))
    return exposed


def _read_besides(snap: GraphSnapshot, view: str, x: str) -> bool:
    """Whether the tensor ``view`` takes a view (or a copy) of, ``x``, is read other than through
    ``view``: by another node than the next one down, from ``x`` up through what it is a view of.
    If not, no reader can tell a view from a copy (a classifier's ``flatten(pool(y))`` written by an
    in-place activation, nothing else reading the pool's output)."""
    below, at = view, x
    while True:
        if snap.users.get(at, ()) != (below,):
            return True
        viewed = [y for y, _, is_view, _ in _effects(snap.node(at), snap.dialect) if is_view]
        if not viewed:  # a tensor of its own: read through ``view`` alone
            return False
        if len(viewed) > 1:
            return True
        below, at = at, viewed[0]


@final
@dataclass(frozen=True, slots=True)
class _Aliasing:
    """A snapshot's views and in-place writes: those of the captured program, and those of the
    nodes earlier stages added."""

    root: dict[str, str]  # a view -> the tensor it views
    copies: set[str]  # views that may be copies (``MAYBE_COPIES``), or of one
    at: dict[str, list[tuple[int, str]]]  # a tensor -> (index, node) of each write to it
    of: dict[str, list[str]]  # a tensor -> its views


def _aliasing(cap: Captured, snap: GraphSnapshot) -> _Aliasing:
    root, copies = dict(cap.views), set(cap.copies)
    at: dict[str, list[tuple[int, str]]] = {}
    for node, value in cap.writes:
        if node in snap.index:
            at.setdefault(value, []).append((snap.index[node], node))
    for i, n in enumerate(snap.nodes):
        if n.op != "call_function" or n.name in cap.snap.index:
            continue
        for x, write, view, copy in _effects(n, snap.dialect):
            if write:
                at.setdefault(root.get(x, x), []).append((i, n.name))
            if view:
                root[n.name] = root.get(x, x)
                if copy or x in copies:
                    copies.add(n.name)
    of: dict[str, list[str]] = {}
    for v, r in root.items():
        of.setdefault(r, []).append(v)
    # (``broadcast_tensors``: a view of each, through its elements; the last first, so that one of
    # an earlier one's elements is among its views too)
    for m, tensors in reversed(cap.shared.items()):
        for r in tensors:
            of.setdefault(r, []).extend([m, *of.get(m, ())])
    return _Aliasing(root, copies, at, of)


# (canonical target, dialect) -> whether it returns an alias, its aliased arguments, whether it may copy
_ALIASING: dict[tuple[str, str], tuple[bool, tuple[tuple[int, str, bool], ...], bool]] = {}


def _effects(node: NodeSnapshot | NewNode, dialect: str) -> list[tuple[str, bool, bool, bool]]:
    """For each node a new node reads as an aliased argument: (its name, whether the node writes
    it, whether the node's result is a view of it, whether that view may be a copy)."""
    if node.target == "getitem":  # an element of a split: a view when the split is one
        source = node.args[0] if node.args else None
        return [(source.name, False, True, False)] if isinstance(source, NodeRef) else []
    known = _ALIASING.get((node.target, dialect))
    if known is None:
        try:
            target = resolve_target(node.target, dialect)
        except ValueError:  # an op torch does not have: the commit refuses the plan
            return []
        known = _ALIASING[(node.target, dialect)] = (*aliases(target), may_copy(target))
    returns_alias, args, copy = known
    out = []
    for i, name, write in args:
        value = node.args[i] if 0 <= i < len(node.args) else node.kwargs.get(name)
        for x in refs(value):
            out.append((x, write, returns_alias, copy))
    return out


def _moved_writes(snap: GraphSnapshot, p: RewritePlan, al: _Aliasing) -> list[str]:
    """The writes that the uses ``p`` moves would see, or make, on another tensor than before: from
    each replaced node to the last use of it or of a view of it, a write to the tensor it was (a
    use writing it would now write its replacement) or to the tensor replacing it (the uses would
    read it)."""
    out = []
    for old, new in p.replace:
        was = al.root.get(old, old)
        now, copy = _tensor_of(snap, p, new, al)
        if now is None or (now == was and not copy and old not in al.copies):  # a new tensor, or the same
            continue
        start = snap.index[old]
        readers = [old, *(v for v in al.of.get(was, ()) if snap.index.get(v, -1) > start)]
        stop = max((snap.index[u] for r in readers for u in snap.users.get(r, ())), default=start)
        out += [
            f"{w} writes {old} in place, which would write {new}" for i, w in al.at.get(was, ()) if start < i <= stop
        ]
        out += [
            f"{w} writes {new} in place while {old}'s uses would read it"
            for i, w in al.at.get(now, ())
            if start < i <= stop and now != was
        ]
    return out


def _lost_writes(snap: GraphSnapshot, p: RewritePlan, al: _Aliasing) -> list[str]:
    """The in-place writes ``p`` removes (a node it erases, replaces or prunes writes a tensor) that no
    new node of ``p`` makes again, where the written tensor is seen after the write: a tensor the
    program holds or is given (its state, its caller's input), or one a node ``p`` keeps reads after
    it, directly or through a view (``F.hardswish(x[:4], inplace=True)`` replaced by a functional
    hardswish would leave ``x`` unwritten). A write only the removed nodes see goes with them, and so
    does one seen only through a node whose uses the plan moves (``y.mul_(k)`` folded into the conv
    of ``y``: a later ``relu_`` of its result reads the new conv, which holds the written value)."""
    consumed = p.claims | set(p.prune)
    moved = {old for old, _ in p.replace}
    remade = {al.root.get(x, x) for n in p.nodes for x, write, _, _ in _effects(n, snap.dialect) if write}
    out = []
    for tensor, writes in al.at.items():
        for i, w in writes:
            if w not in consumed or tensor in remade:
                continue
            held = tensor in snap.index and snap.node(tensor).op in ("placeholder", "get_attr")
            seen = [
                v
                for v in (tensor, *al.of.get(tensor, ()))
                if v in snap.index and v not in consumed and not _through(snap, v, tensor, moved | {w})
            ]
            later = next((u for v in seen for u in snap.users[v] if snap.index[u] > i and u not in consumed), None)
            if held or later is not None:
                after = "the program holds or is given" if held else f"{later} reads after it"
                out.append(f"{w} writes {tensor} in place, which {after}: the plan removes the write")
    return out


def _through(snap: GraphSnapshot, view: str, tensor: str, nodes: set[str]) -> bool:
    """The view ``view`` of ``tensor`` is taken through one of ``nodes`` (itself one, or a view of one)."""
    seen: set[str] = set()
    while view != tensor and view not in seen:
        if view in nodes:
            return True
        seen.add(view)
        parent = next((x for x, _, is_view, _ in _effects(snap.node(view), snap.dialect) if is_view), None)
        if parent is None or parent not in snap.index:
            return False
        view = parent
    return view in nodes


def _tensor_of(snap: GraphSnapshot, p: RewritePlan, name: str, al: _Aliasing) -> tuple[str | None, bool]:
    """The tensor whose storage ``name`` (a node of ``snap`` or of ``p``) holds: the node itself, or
    the one it is a view of, and whether one of the views between may be a copy; None for a tensor
    ``p`` computes anew."""
    made = {n.name: n for n in p.nodes}
    copy = False
    while name in made:
        views = [(x, c) for x, _, view, c in _effects(made[name], snap.dialect) if view]
        if not views:
            return None, False
        name, c = views[0]
        copy = copy or c
    return al.root.get(name, name), copy or name in al.copies


def _unwritable(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan with a new node that copies a literal fxpure cannot write into a program (an
    opaque object it captured as text, other than a memory format or layout), with the reason:
    declined before anything is applied, the other plans still are."""
    out: dict[tuple[str, str], Reason] = {}
    for p in report.plans:
        for n in p.nodes:
            bad = _opaque((*n.args, *n.kwargs.values()))
            if bad is not None:
                detail = f"new node {n.name} has the argument {bad.text}, which fxpure cannot write into a program"
                out[(p.rule, p.anchor)] = Declined(code="unsupported-argument", node=p.anchor, detail=detail)
                break
    return out


def _refused(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan that writes an op the program's own verifier refuses (an edge program takes Core
    ATen ops and the exceptions it was made with: ``aten.linear`` is not one), on an edge program
    a call of tensors of dtypes the op's kernels do not take (the verifier's own dtype check: a
    float16 ``mul`` of a float32 tensor), or an ATen op ExecuTorch has no out variant of (a view
    such as ``aten.permute``: ``to_executorch`` would fail), with the reason."""
    if not isinstance(cap.program, ExportedProgram) or not report.plans:
        return {}
    verifiers = [v() for v in cap.program.verifiers]
    checked = cap.snap.dialect == "edge" and all(getattr(v, "enable", True) for v in verifiers)
    why: dict[str, str | None] = {}
    out: dict[tuple[str, str], Reason] = {}
    for snap, stage in planned_on(report):
        for p in stage:
            # what a new node reads: the plan's own constants and nodes, else the snapshot planned on
            local: dict[str, object] = (
                {c.name: infer_spec(c.expr).value_or(None) for c in p.constants} | {n.name: n.spec for n in p.nodes}
                if checked
                else {}
            )
            for n in p.nodes:
                if n.target not in why:
                    why[n.target] = _refusal(n.target, cap.snap.dialect, verifiers, edge=checked)
                detail = why[n.target] or (_mistyped(n, local, snap) if checked else None)
                if detail is not None:
                    out[(p.rule, p.anchor)] = Declined(code="op-not-allowed", node=p.anchor, detail=detail)
                    break
    return out


def _refusal(target: str, dialect: str, verifiers: Sequence[Any], *, edge: bool) -> str | None:
    try:
        op: Any = resolve_target(target, dialect)
    except ValueError:
        return None  # an unknown op is refused, with its name, when the plan is applied
    for v in verifiers:
        try:
            v.check_valid_op(op)
        except SpecViolationError as e:
            # its first line (torch's message closes a quote it never opened: dropped)
            first = next((line.strip().rstrip('"') for line in str(e).splitlines() if line.strip()), "")
            return f"the program's verifier refuses {target}: {first}"
    if not edge or not target.startswith("aten."):
        return None  # (another library's op, as ``et_vk``'s, may be one only a delegate runs)
    from executorch.exir.passes import to_out_var_skiplist  # (an edge program's: ExecuTorch is there)

    if op in to_out_var_skiplist:
        return None
    schema = op._schema
    if schema.is_mutable or schema.overload_name == "out" or schema.name.endswith("_"):
        return None
    try:
        op.to_out_variant()
    except RuntimeError:
        name, overload = target.rsplit(".", 1)
        copy = f"{name}_copy.{overload}"
        try:
            resolve_target(copy, dialect)
            hint = f" (the edge program's spelling: {copy})"
        except ValueError:
            hint = ""
        return f"ExecuTorch has no out variant of {target}: to_executorch would fail{hint}"
    return None


def _mistyped(n: NewNode, local: Mapping[str, object], snap: GraphSnapshot) -> str | None:
    """Why an edge op's kernels do not take ``n``'s tensors' dtypes (none where it cannot say);
    what it reads is its plan's (``local``: new constants and nodes by name) or ``snap``'s."""
    op: Any = resolve_target(n.target, "edge")
    constraint = getattr(getattr(op, "_schema", None), "dtype_constraint", None)
    if constraint is None:
        return None
    dtypes: dict[str, torch.dtype | None] = {}
    for i, a in enumerate(op._schema.arguments):
        value = (
            n.kwargs.get(a.name) if a.name in n.kwargs else n.args[i] if i < len(n.args) and not a.kwarg_only else None
        )
        first = value[0] if isinstance(value, tuple) and value and type(value[0]) is NodeRef else value
        name = first.name if type(first) is NodeRef else ""
        spec = local[name] if name in local else snap.node(name).spec if name in snap.index else None
        if isinstance(spec, TensorSpec):
            dtypes[a.name] = dtype_of(spec.dtype)
    outs = n.spec if isinstance(n.spec, tuple) else (n.spec,)
    for i, (r, spec) in enumerate(zip(op._schema.returns, outs, strict=False)):
        if isinstance(spec, TensorSpec):
            dtypes[r.name or f"__ret_{i}"] = dtype_of(spec.dtype)
    if constraint.validate(dtypes):
        return None
    held = ", ".join(f"{k} {dtype_name(d)}" for k, d in dtypes.items() if d is not None)
    return f"the program's verifier refuses {n.target} of {held}: its kernels take no such dtypes"


def _computed(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan's new nodes run on fake values, in the program's own fake mode (values of symbolic
    sizes at the sizes the program was exported at, in a fake mode of their own), stage after stage:
    a plan with a node torch refuses (a conv given an input of other channels than its weight), or
    one computing another dtype or shape than its plan declares (its readers, and the program's
    meta, take the declared one), is a ``plan-conflict``. On an edge program, a node that reads a
    channels-last tensor and that torch lays out otherwise (a ``slice_copy`` of it is contiguous) is
    ``dim-order-changes``: ExecuTorch takes dim orders from torch's fake values, and its portable
    kernels refuse an op whose input and output dim orders differ, so the ``.pte`` would fail at run
    time (unless a delegate takes the node, which the program does not say); values are judged as
    ExecuTorch will lay them out (:func:`_edge_layouts`), and on an aten program only the new views
    (an op ``to_edge`` decomposes runs as what it becomes). An op only a delegate
    runs (``et_vk``), or one torch cannot run on fake values, is not checked. With the reason."""
    fakes = _Fakes.of(cap.gm)
    if fakes.mode is None or not report.plans:
        return {}
    vals = {n.name: n.meta.get("val") for n in cap.gm.graph.nodes}
    layout = _edge_layouts(cap)
    out: dict[tuple[str, str], Reason] = {}
    runs: dict[Hashable, tuple[Any, str | None]] = {}
    before: GraphSnapshot | None = None
    for snap, stage in planned_on(report):
        if not stage:
            continue
        if before is not None:  # the earlier stage's new nodes, by their names in this snapshot
            for rec in snap.nodes:
                if rec.name not in before.index:
                    vals[rec.name] = _ran(fakes, rec, snap.dialect, vals, layout, runs)[0]
        for p in stage:
            local = {c.name: _spec_value(fakes, infer_spec(c.expr).value_or(None)) for c in p.constants}
            for node in p.nodes:
                local[node.name], why = _ran(fakes, node, snap.dialect, ChainMap(local, vals), layout, runs)
                if why is not None:
                    code, detail = why
                    kind = PlanConflict if code == "plan-conflict" else partial(Declined, code=code)
                    out.setdefault((p.rule, p.anchor), kind(node=p.anchor, detail=detail))
                    break
        before = snap
    return out


def _spec_value(fakes: _Fakes, spec: object) -> Any:
    """A fake value of ``spec``, or None (what cannot be made is left unchecked: never an error)."""
    try:
        return fakes.value(spec) if isinstance(spec, TensorSpec) else None
    except Exception:
        return None


# what torch raises when a kernel's own checks refuse its arguments (shapes, dtypes); anything else
# (no fake kernel, a size the fake mode cannot decide) leaves the node unchecked
_REFUSED = (RuntimeError, ValueError, IndexError)


def _ran(
    fakes: _Fakes,
    node: NewNode | NodeSnapshot,
    dialect: str,
    env: Mapping[str, Any],
    layout: set[str],
    runs: dict[Hashable, tuple[Any, str | None]],
) -> tuple[Any, tuple[str, str] | None]:
    """A new node's fake value (the one its spec declares where torch does not compute it), and the
    code and detail of why its plan is declined, if it is. ``runs``: the outcome of each call by
    its op, its literal arguments and what it reads (shape, dtype, strides), made once (a model of
    repeated blocks makes the same few calls many times)."""
    declared = _spec_value(fakes, node.spec)
    if isinstance(node, NodeSnapshot) and node.op != "call_function":  # a new constant
        return declared, None
    if node.target.split(".")[0] in OP_LIBRARIES:
        return declared, None
    reads: dict[str, Any] = {r: env.get(r) for r in refs((*node.args, *node.kwargs.values()))}
    if any(v is None for v in reads.values()):
        return declared, None
    mode = fakes.mode
    # values of symbolic sizes run at the program's example sizes, in a fake mode of their own: in the
    # program's shape environment a fake kernel's guards would narrow (or pin) the program's symbols
    if not all(_static(v, mode) for v in reads.values()):
        reads = {r: fakes.sized(v) for r, v in reads.items()}
        if any(v is None for v in reads.values()):
            return declared, None
        mode = fakes.sized_mode
    try:
        key: Hashable = (node.target, _signature(node.args, reads), _signature(tuple(node.kwargs.items()), reads))
        hash(key)
    except Exception:  # an unhashable literal, a tensor without strides: run every time
        key = object()
    if key not in runs:
        runs[key] = _fake_call(mode, node, dialect, reads)
    ran, error = runs[key]
    at = "" if mode is fakes.mode else " (at the sizes the program was exported at)"
    if error is not None:
        return declared, ("plan-conflict", f"new node {node.name} cannot run{at}: {error}")
    if ran is None:
        return declared, None
    got = tuple(map(tensor_spec, ran)) if isinstance(ran, (tuple, list)) else tensor_spec(ran)
    # at the example sizes, the declared spec's symbolic sizes too (those the program's values have)
    there = tensor_spec(fakes.sized(declared)) if at and isinstance(declared, torch.Tensor) else None
    want = there or node.spec
    if want is not None and got is not None and specs_differ(want, got):
        also = f" ({shown(want)} there)" if there is not None and there != node.spec else ""
        detail = f"new node {node.name} computes {shown(got)}{at}, its plan declares {shown(node.spec)}{also}"
        return declared, ("plan-conflict", detail)
    if not isinstance(ran, torch.Tensor):  # a tuple (a split's parts, which a getitem then picks), or none
        return (tuple(ran) if isinstance(ran, (tuple, list)) else declared), None
    first = next((r for r, v in reads.items() if isinstance(v, torch.Tensor) and v.dim() == ran.dim()), None)
    if first is None or first not in layout:
        return ran, None
    # (a one-channel output is also contiguous: its strides, not torch's contiguity, give its dim order;
    # to_edge makes an aten program's view a copy, laid out contiguous)
    copied = dialect != "edge" and _copied(resolve_target(node.target, dialect))
    order = tuple(range(ran.dim())) if copied else _dim_order(ran)
    if order == _dim_order(ran) and _channels_last(ran) and node.target not in _LEGALIZED:
        layout.add(node.name)  # (a value a later node reads)
    # an aten op other than a view runs as what to_edge makes of it (a linear decomposes): not judged here
    # (a dim order op, ``_clone_dim_order`` say, is there to change it: ``x.contiguous()`` lowered)
    converts = node.target.startswith("dim_order_ops.")
    if (dialect == "edge" or copied) and order != _dim_order(reads[first]) and not converts:
        what = f"{node.name} (a copy once lowered)" if copied else node.name
        why = f"{what} would read a channels-last tensor and write one laid out otherwise"
        kernels = "ExecuTorch's portable kernels want one dim order for an op's input and output"
        sizes = tuple(ran.shape)  # (a copy's strides are contiguous ones)
        strides = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes))) if copied else ran.stride()
        return ran, ("dim-order-changes", f"{why} (strides {strides}): {kernels}")
    return ran, None


def _signature(arg: Arg, reads: Mapping[str, Any]) -> Hashable:
    """An argument tree with each node it reads as that value's shape, dtype and strides, and each
    literal with its type (``2`` and ``2.0`` make different calls)."""
    if type(arg) is NodeRef:
        return _signature_value(reads[arg.name])
    if isinstance(arg, (tuple, list)):
        return tuple(_signature(a, reads) for a in arg)
    return (type(arg), arg)


def _signature_value(v: Any) -> Hashable:
    """A tensor, or a tuple of them, as its shapes, dtypes and strides (TypeError for anything else)."""
    if isinstance(v, (tuple, list)):
        return tuple(_signature_value(x) for x in v)
    if not isinstance(v, torch.Tensor):
        raise TypeError("not a tensor")
    return (tuple(v.shape), v.dtype, v.stride())


def _fake_call(
    mode: Any, node: NewNode | NodeSnapshot, dialect: str, reads: Mapping[str, Any]
) -> tuple[Any, str | None]:
    """The call's fake value (None where torch cannot compute one), or why torch refuses it."""
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs each fake kernel's failure
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        op = resolve_target(node.target, dialect)
        schema = getattr(op, "_schema", None)
        if schema is None and op is not operator.getitem:  # (``getitem`` picks a fake value)
            return None, None
        with mode:
            if schema is not None and schema.is_mutable:  # on copies: not the program's own fake values
                reads = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in reads.items()}
            args = _bind(tuple(_literal(a) for a in node.args), reads)
            kwargs = _bind({k: _literal(v) for k, v in node.kwargs.items()}, reads)
            return op(*args, **kwargs), None
    except Exception as e:
        # (a getitem of the wrong arguments is a TypeError, as a wrong call of any Python function)
        if type(e) not in _REFUSED and not (node.target == "getitem" and isinstance(e, TypeError)):
            return None, None
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    finally:
        quiet.setLevel(level)


def _static(value: Any, mode: Any) -> bool:
    """``value`` holds no symbolic size, and its tensors are fake values of ``mode``."""
    if isinstance(value, torch.Tensor):
        return getattr(value, "fake_mode", None) is mode and all(isinstance(d, int) for d in value.shape)
    if isinstance(value, (tuple, list)):
        return all(_static(v, mode) for v in value)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


# ops whose input ExecuTorch lays out contiguous before their portable kernel runs (its
# LegalizePortableDimOrderPass): their value is contiguous in the .pte, whatever torch computes
_LEGALIZED = frozenset(
    {
        "aten.avg_pool2d.default",
        "aten._adaptive_avg_pool2d.default",
        "aten.adaptive_avg_pool2d.default",
        "aten.mean.dim",
        "aten.sum.dim_IntList",
        "aten.expand.default",
        "aten.expand_copy.default",
    }
)
_CHANNELS_LAST_ORDER = (0, 2, 3, 1)


def _copied(op: object) -> bool:
    """``to_edge`` spells the aten op as a copy, laid out contiguous: a view (``slice`` as
    ``slice_copy``; ``view``, ``permute``, ``reshape``), not a cast that may return its input
    (``to`` becomes ``_to_copy``, which keeps the layout)."""
    name = getattr(getattr(op, "_overloadpacket", None), "__name__", "")
    return name in ("reshape", "_unsafe_view") or (aliases(op)[0] and hasattr(torch.ops.aten, f"{name}_copy"))


def _edge_layouts(cap: Captured) -> set[str]:
    """The nodes of an ExportedProgram whose value ExecuTorch will take as laid out channels last:
    an input so laid out, an op asked for it (``memory_format``, ``dim_order``), or an op laid out
    so from such a value; not an aten view (``to_edge`` makes it a copy, contiguous), nor an op whose
    input ExecuTorch makes contiguous first (a pool, a mean: :data:`_LEGALIZED`). A GraphModule is not
    lowered: none."""
    if not cap.snap.lifted:
        return set()
    out: set[str] = set()
    for n in cap.gm.graph.nodes:
        if not _channels_last(n.meta.get("val")):
            continue
        if n.op == "placeholder":
            out.add(n.name)
            continue
        if n.op != "call_function" or target_name(n.target) in _LEGALIZED:
            continue
        order = n.kwargs.get("dim_order")
        asked = n.kwargs.get("memory_format") is torch.channels_last or (
            isinstance(order, (list, tuple)) and tuple(order) == _CHANNELS_LAST_ORDER
        )
        # (an element of a tuple-output op, a max pool's with its indices: laid out from that op's inputs)
        ins = n.all_input_nodes
        if n.target is operator.getitem and ins:
            ins = ins[0].all_input_nodes
        if asked or (any(a.name in out for a in ins) and not _copied(n.target)):
            out.add(n.name)
    return out


def _channels_last(v: object) -> bool:
    """``v`` is a 4-D tensor laid out channels last, and not also contiguous (size-1 dims)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        return False
    try:
        return bool(v.is_contiguous(memory_format=torch.channels_last)) and not bool(v.is_contiguous())
    except Exception:  # a symbolic layout torch cannot decide: taken as contiguous
        return False


def _dim_order(v: torch.Tensor | None) -> tuple[int, ...] | None:
    """The dim order ExecuTorch takes from ``v``'s strides (None where torch cannot say)."""
    try:
        return tuple(v.dim_order()) if v is not None else None
    except Exception:
        return None


def _writes_state(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan with a new node that writes in place, directly or through a view, a tensor the
    program holds or is given (a parameter, a buffer, a constant, an input): the model's own
    state, or its caller's tensor, would change on every call. With the reason."""
    out: dict[tuple[str, str], Reason] = {}
    for snap, stage in planned_on(report):
        for p in stage:
            base: dict[str, str] = {}  # a new view: the tensor it views
            for n in p.nodes:
                for x, write, view, copy in _effects(n, snap.dialect):
                    x = base.get(x, x)
                    held = x in snap.index and snap.node(x).op in ("placeholder", "get_attr")
                    if write and held:
                        detail = f"new node {n.name} writes {x} in place, a tensor the program holds or is given"
                        out[(p.rule, p.anchor)] = PlanConflict(node=p.anchor, detail=detail)
                    elif view and not copy:
                        base[n.name] = x
    return out


def _unheld(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan with a new constant that reads a tensor the program holds as no constant (a
    buffer it writes in place, a value it computes: a hand-written ``Source`` of it), or reads one
    as another shape or dtype than it has, with the reason."""
    out: dict[tuple[str, str], Reason] = {}
    held: dict[str, TensorSpec | None] = {}  # each key's spec, read once
    for p in report.plans:
        for c in p.constants:
            for e in source_exprs(c.expr):
                if e.key not in held:
                    t = cap.tensors.get(e.key)
                    held[e.key] = None if t is None else tensor_spec(t)
                spec = held[e.key]
                if spec is None:
                    detail = f"constant {c.name} reads {e.key}, which the program holds as no constant"
                elif spec != e.spec:
                    detail = f"constant {c.name} reads {e.key} as {shown(e.spec)}, which holds {shown(spec)}"
                else:
                    continue
                out[(p.rule, p.anchor)] = PlanConflict(node=p.anchor, detail=detail)
    return out


def _unspecified(cap: Captured, report: RewriteReport) -> dict[tuple[str, str], Reason]:
    """Every plan with a new node of no spec, in an exported program, which holds every node's value
    (``meta["val"]``: without one it fails ``validate()``, and ``to_edge``), with the reason."""
    if not isinstance(cap.program, ExportedProgram):
        return {}
    out: dict[tuple[str, str], Reason] = {}
    for p in report.plans:
        blank = next((n.name for n in p.nodes if n.spec is None), None)
        if blank is not None:
            detail = f"new node {blank} declares no spec, and an exported program holds every node's value"
            out[(p.rule, p.anchor)] = PlanConflict(node=p.anchor, detail=detail)
    return out


# what the core cannot know of a plan, found on the program: each maps the plans it declines to why
_CHECKS: tuple[Callable[[Captured, RewriteReport], dict[tuple[str, str], Reason]], ...] = (
    _unwritable,
    _unheld,
    _writes_state,
    _crossing,
    _inside_preserved,
    _refused,
    _written_between,
    _returns_aliased,
    _restrided,
    _computed,
    _unspecified,  # (last: where a node of no spec makes another check fail too, this says why)
)


def _known_ops(report: RewriteReport, dialect: str) -> None:
    """Raises _ApplyError (``unknown-op``, naming the rule and its anchor) if a plan writes an op
    torch does not have: a rule's mistake, not its candidate's (the whole transform fails)."""
    for p in report.plans:
        for target in dict.fromkeys(n.target for n in p.nodes):
            try:
                resolve_target(target, dialect)
            except ValueError as e:
                raise _ApplyError("unknown-op", f"{e} (a plan of rule {p.rule!r} at {p.anchor})") from e


def _checked(cap: Captured, report: RewriteReport) -> list[dict[tuple[str, str], Reason]]:
    """What each check of ``_CHECKS`` finds wrong with ``report``'s plans, in turn; _ApplyError where
    torch fails in one (nothing was touched)."""
    try:
        return [check(cap, report) for check in _CHECKS]
    except _ApplyError:
        raise
    except Exception as e:
        raise _ApplyError("apply-failed", f"checking the plans failed: {type(e).__name__}: {e}") from e


def _unsound(
    cap: Captured, report: RewriteReport, new: Mapping[str, torch.Tensor], memo: dict[object, torch.Tensor]
) -> tuple[list[str], dict[str, tuple[WeightExpr, ...]]]:
    """The new constants that are not finite (:func:`_non_finite`), or else those that underflow
    (:func:`_underflows`); _ApplyError where torch fails comparing numbers it computed (nothing was
    touched)."""
    try:
        bad = _non_finite(new, report.after, cap.tensors)
        if bad:  # (what the program computes itself, computed ahead, is no inf a fold brings in)
            ahead = _computed_ahead(report)
            bad = [k for k in bad if report.after.constants[k].source not in ahead]
        return bad, ({} if bad else _underflows(new, report, cap.tensors, memo))
    except Exception as e:
        raise _ApplyError("apply-failed", f"checking the new constants failed: {type(e).__name__}: {e}") from e


_NONE = torch.empty(0, dtype=torch.float64)


def _bounds(e: object) -> tuple[WeightExpr, float, float, bool, str] | None:
    """What values an expression needs of its operand: bounds, whether they bound the values'
    integer parts (``[low, high)``), and how a message says it. A ``Within``'s range; for a float
    cast to an integer dtype (or summed as one, which casts first) the values that dtype holds once
    truncated (torch leaves any other value undefined: 300.0 as int8 is whatever the CPU makes of
    it). Each bound is exact in float64. (A quantization is checked apart: :func:`_violation`.)"""
    if isinstance(e, Within):
        return e.x, e.low, e.high, False, f"values in [{e.low:g}, {e.high:g}]"
    if isinstance(e, Cast | SumOver) and e.dtype in INT_RANGES and _spec_dtype(e.x) in FLOAT_DTYPES:
        lo, hi = INT_RANGES[e.dtype]
        return e.x, lo, hi + 1, True, f"values a cast to {e.dtype} holds, [{lo}, {hi}] once truncated"
    return None


def _violation(e: object, value: Callable[[WeightExpr], torch.Tensor]) -> str | None:
    """What ``e`` needs of the values it is computed from and they do not give, as a message says
    it, or None; ``value``: the values computed. A quantization needs numbers where it casts:
    ``round(x * (1 / scale)) + zero_point`` NaN (a NaN of ``x``, or ``0 * (1 / 0)`` of a zero
    scale) clamps to NaN, then to whatever torch's cast makes of it."""
    if isinstance(e, Quantize):
        nan = int(quantized_values(e, value).isnan().sum())
        return f"numbers to quantize, no NaN; {nan} of them are NaN" if nan else None
    need = _bounds(e)
    if need is None:
        return None
    x, low, high, truncated, what = need
    flat, step = value(x).reshape(-1), 1 << 20
    if flat.dtype == torch.int64 and not truncated:  # (float64 rounds one past 2**53: 2**53 + 1 <= 2**53)
        bad = flat[_beyond_int64(flat, low, high)].to(torch.float64)
    else:
        # compared in float64, a million values at a time: torch would cast a bound to an integer
        # value's dtype (-1 to 255 for uint8), and compares no uint16 or float8
        wide = (flat[i : i + step].to(torch.float64) for i in range(0, flat.numel(), step))
        bad = torch.cat([v[_beyond(v, float(low), float(high), truncated)] for v in wide] or [_NONE])
    if not bad.numel():
        return None
    ends = (bad.min().item() + 0.0, bad.max().item() + 0.0)  # (-0.0 is 0 in a message)
    span = f"{ends[0]:g} to {ends[1]:g}" if not bad.isnan().any() else "NaN"
    return f"{what}; {bad.numel()} of them are {span}"


def _beyond(v: torch.Tensor, low: float, high: float, truncated: bool) -> torch.Tensor:
    """Where ``v`` lies outside ``[low, high]`` (``truncated``: where its integer part lies outside
    ``[low, high)``), NaN included."""
    if truncated:
        t = torch.trunc(v)
        return ~((t >= low) & (t < high))
    return ~((v >= low) & (v <= high))


def _beyond_int64(v: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where the int64 ``v`` lies outside ``[low, high]``, compared exactly: an integer is at least
    ``low`` where it is at least its ceiling (bounds past int64's range, or NaN, as such)."""
    if math.isnan(low) or math.isnan(high):
        return torch.ones_like(v, dtype=torch.bool)
    lo, hi = math.ceil(max(low, -(2.0**64))), math.floor(min(high, 2.0**64))
    if lo > _INT64_MAX or hi < -_INT64_MAX - 1:
        return torch.ones_like(v, dtype=torch.bool)
    return (v < max(lo, -_INT64_MAX - 1)) | (v > min(hi, _INT64_MAX))


_INT64_MAX = 2**63 - 1


def _inner_first(expr: WeightExpr) -> list[WeightExpr]:
    """``expr``'s subexpressions, each after those it is computed from, in field order: the order
    a failure is met computing it, whatever the hash seed."""
    out: list[WeightExpr] = []
    seen: set[WeightExpr] = set()

    def walk(e: WeightExpr) -> None:
        if e not in seen:
            seen.add(e)
            for c in children(e):
                walk(c)
            out.append(e)

    walk(expr)
    return out


def _spec_dtype(e: WeightExpr) -> str:
    return infer_spec(e).map(lambda s: s.dtype).value_or("")


def _outside(cap: Captured, report: RewriteReport, memo: dict[object, torch.Tensor]) -> dict[tuple[str, str], Reason]:
    """The plans one of whose constants holds a :class:`~fxpure.weights.Within` some value of which
    (NaN too) lies outside its range, that casts (or sums) a float outside the integer dtype it casts
    to, or quantizes a NaN, with why
    (``value-range``, at ``plan.<constant>``); _ApplyError where torch fails comparing the values it
    computed (nothing was touched). ``memo``: the one the constants were computed with (every such
    expression a live constant holds is in it: where none is, the plans' expressions are not walked,
    15-20 ms of a transform at 4,002 nodes)."""
    out: dict[tuple[str, str], Reason] = {}
    if not any(isinstance(e, Quantize) or _bounds(e) for e in memo):
        return out

    def value(e: WeightExpr) -> torch.Tensor:  # (the memo's own tensor: no copy)
        if isinstance(e, Source):
            return cap.tensors[e.key]
        return memo[e] if e in memo else materialize(e, cap.tensors, memo)

    try:
        for p in report.plans:
            for c in p.constants:
                for e in _inner_first(c.expr):  # (the first failure met computing it)
                    found = _violation(e, value)
                    if found is not None:
                        detail = f"{c.name} needs {found}"
                        out[(p.rule, p.anchor)] = Declined(
                            code="value-range", node=p.anchor, path=f"plan.{c.name}", detail=detail
                        )
                        break
                if (p.rule, p.anchor) in out:
                    break
    except Exception as e:
        raise _ApplyError("apply-failed", f"checking the new constants failed: {type(e).__name__}: {e}") from e
    return out


def _finite_plan(
    cap: Captured, rules: Sequence[Rule], *, dry_run: bool
) -> tuple[RewriteReport, dict[str, torch.Tensor]]:
    """Plan, compute the new constants, and decline (then plan again without) every plan a check of
    ``_CHECKS`` finds wrong on the program (a constant it cannot read, a write to the program's
    state, a node a preserved module call signature names, an op the verifier refuses, a write
    between reads, a node torch computes otherwise), whose constants hold a value a ``Within``
    excludes, or whose constants are not finite; raises _ApplyError if a constant cannot be computed."""
    declined: dict[tuple[str, str], Reason] = {}
    while True:
        report = fxpure.plan(cap.snap, rules, declined=declined)
        _known_ops(report, cap.snap.dialect)  # a dry run says so as applying would
        # a check's reason is about the plan, not a place in the pattern: located at ``plan``
        found = {
            k: v if v.path else replace(v, path="plan")
            for checked in _checked(cap, report)
            for k, v in checked.items()
            if k not in declined
        }
        if found:
            declined.update(_earliest(report, found))
            continue
        memo: dict[object, torch.Tensor] = {}
        try:
            new = _materialize_new(cap, report.after, memo) if report.plans else {}
        except _ApplyError as e:
            if dry_run and e.code == "meta-tensor":  # a dry run reports the plans, without numbers
                return report, {}
            raise
        outside = {k: v for k, v in _outside(cap, report, memo).items() if k not in declined}
        if outside:
            declined.update(_earliest(report, outside))
            continue
        bad, flushed = _unsound(cap, report, new, memo)
        more = {k: v for k, v in _culprits(report, bad, flushed).items() if k not in declined}
        if not bad and not flushed:
            return report, new
        if not more:
            code = "non-finite-weight" if bad else "weight-underflow"
            first = bad[0] if bad else next(iter(flushed))
            raise _ApplyError(code, f"{first} is not finite or underflows, and no plan computes it")
        declined.update(_earliest(report, more))


def _earliest(report: RewriteReport, found: dict[tuple[str, str], Reason]) -> dict[tuple[str, str], Reason]:
    """Of the plans found wrong, those of the earliest stage with any: a later stage was planned on
    what the earlier ones made, so it is planned again without them (and may then be right)."""
    for stage in report.stages:
        here = {k: found[k] for p in stage if (k := (p.rule, p.anchor)) in found}
        if here:
            return here
    return found


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
    except Exception as e:  # torch failing to read a tensor of it, say: nothing was touched
        message = f"cannot read the program: {type(e).__name__}: {e}"
        return Failure(TransformError(code="unsupported-program", message=message))


def _with_unreachable(cap: Captured, report: RewriteReport, rules: Sequence[Rule]) -> RewriteReport:
    """The report plus a typed decline for every candidate the rules cannot reach: in a control-flow
    branch, or a module call of a ``symbolic_trace`` GraphModule."""
    extra = [Rejection(rule=r.name, node=node, reason=reason) for r in rules for node, reason in unreachable(cap, r)]
    return replace(report, rejections=(*report.rejections, *extra)) if extra else report


def _reserving(cap: Captured, names: Iterable[str]) -> Captured:
    """``cap`` whose new constants and nodes take none of ``names`` either."""
    more = frozenset(names) - cap.snap.reserved
    return replace(cap, snap=replace(cap.snap, reserved=cap.snap.reserved | more)) if more else cap


def transform(
    program: Program, rules: Iterable[Rule], *, dry_run: bool = False, reserved: Iterable[str] = ()
) -> Result[TransformOutcome, TransformError]:
    """Plan ``rules`` on ``program`` and apply them in place, all or nothing. ``reserved``: keys a new
    constant must not take besides the program's own (those other methods of one ``.pte`` hold for
    other values: ExecuTorch's external constant file keeps one tensor per key)."""
    rules = check_rules(rules)
    keys = () if isinstance(reserved, (str, bytes)) or not isinstance(reserved, Iterable) else tuple(reserved)
    if (
        not isinstance(reserved, Iterable)
        or isinstance(reserved, (str, bytes))
        or not all(isinstance(k, str) for k in keys)
    ):
        raise TypeError(f"reserved must be an iterable of key names, not {reserved!r}")
    names = frozenset(keys)

    def go(cap: Captured) -> Result[TransformOutcome, TransformError]:
        cap = _reserving(cap, names)
        try:
            report, new = _finite_plan(cap, rules, dry_run=dry_run)
        except _ApplyError as e:
            return Failure(TransformError(code=e.code, message=str(e)))
        report = _with_unreachable(cap, report, rules)
        if dry_run:
            return Success(TransformOutcome(report=report, changed=False))
        return _run(cap, report, new)

    with no_cyclic_gc(), plain_torch():
        return _captured(program).bind(go)


def apply(program: Program, plans: Sequence[RewritePlan] | RewriteReport) -> Result[TransformOutcome, TransformError]:
    """Apply plans made on ``capture(program)``: ``capture(apply(g, p)) == rewrite(capture(g), p)``.
    A report (of ``fxpure.plan``, or of ``transform(..., dry_run=True)``) is applied stage by stage,
    as it was planned: a later rule's plans name nodes an earlier rule's plans make; and only to
    the program it was planned on (``plan-conflict`` if its nodes or constants have changed since).
    The checks ``transform`` makes are made here too, and a plan that fails one fails the whole
    apply."""
    listed = () if isinstance(plans, (RewriteReport, str, bytes)) else tuple(plans)
    if isinstance(plans, (str, bytes)) or not all(isinstance(p, RewritePlan) for p in listed):
        raise TypeError(f"apply takes a RewriteReport or a sequence of RewritePlans, not {plans!r}")
    stages = (plans.stages or (plans.plans,)) if isinstance(plans, RewriteReport) else (listed,)

    def go(cap: Captured) -> Result[TransformOutcome, TransformError]:
        changed = changed_since(plans.before, cap.snap) if isinstance(plans, RewriteReport) else None
        if changed is not None:
            return Failure(
                TransformError(code="plan-conflict", message=f"the report was planned on another program: {changed}")
            )
        if isinstance(plans, RewriteReport):  # the names it was planned to leave (``transform(reserved=)``)
            cap = _reserving(cap, plans.before.reserved)
        after = cap.snap
        for stage in stages:
            step = fxpure.rewrite(after, stage)
            if isinstance(step, Failure):
                return Failure(TransformError(code="plan-conflict", message=step.failure().message))
            after = step.unwrap()
        flat = tuple(p for s in stages for p in s)
        report = RewriteReport(plans=flat, rejections=(), before=cap.snap, after=after, stages=stages)
        try:
            for found in _checked(cap, report):
                if found:
                    reason = next(iter(found.values()))
                    raise _ApplyError(reason.code, reason.message)
            memo: dict[object, torch.Tensor] = {}
            new = _materialize_new(cap, report.after, memo)
            outside = _outside(cap, report, memo)
            if outside:
                reason = next(iter(outside.values()))
                raise _ApplyError(reason.code, reason.message)
            bad, flushed = _unsound(cap, report, new, memo)
        except _ApplyError as e:
            return Failure(TransformError(code=e.code, message=str(e)))
        if bad:
            return Failure(TransformError(code="non-finite-weight", message=f"{bad[0]} computes to inf or NaN"))
        if flushed:
            first = next(iter(flushed))
            message = f"{first} loses a channel to {report.after.constants[first].spec.dtype} underflow"
            return Failure(TransformError(code="weight-underflow", message=message))
        return _run(cap, report, new)

    with no_cyclic_gc(), plain_torch():
        return _captured(program).bind(go)
