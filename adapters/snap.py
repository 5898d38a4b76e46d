"""capture: GraphModule / ExportedProgram -> GraphSnapshot, in one pass over the nodes."""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast, final

import torch
from pyrsistent import pmap
from pyrsistent.typing import PMap
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._sympy.value_ranges import bound_sympy

from adapters.torchnames import dtype_name, is_edge, target_name
from fxpure.plan import no_cyclic_gc
from fxpure.reasons import Declined, Reason
from fxpure.snapshot import (
    SMALL_VALUES,
    Arg,
    ConstantInfo,
    ConstantKind,
    DTypeArg,
    GraphSnapshot,
    NodeRef,
    NodeSnapshot,
    Opaque,
    Spec,
    TensorSpec,
    ref_list,
    snapshot,
)

Program = ExportedProgram | torch.fx.GraphModule

_KINDS: dict[InputKind, ConstantKind] = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


_PLAIN = frozenset({int, float, bool, str, type(None)})


def known_int(value: object) -> int | None:
    """The number a node's value is, where it is an int or a size export found constant."""
    return value.node.maybe_as_int() if isinstance(value, torch.SymInt) else value if type(value) is int else None


def _arg(value: Any, refs: dict[torch.fx.Node, NodeRef | int]) -> Arg:
    """An FX argument as an immutable tree; ``refs`` shares one ``NodeRef`` per node (or holds the
    int a node's value is, where export found it constant)."""
    kind = type(value)
    if kind in _PLAIN:
        return cast(Arg, value)
    if kind is torch.fx.Node:
        ref = refs.get(value)
        if ref is None:
            ref = refs[value] = NodeRef(value.name)
        return ref
    if kind is list or kind is tuple:
        return _args(value, refs)
    if isinstance(value, torch.dtype):
        return DTypeArg(dtype_name(value))
    if isinstance(value, (list, tuple)):  # subclasses: torch.fx's immutable_list, named tuples
        return _args(value, refs)
    if isinstance(value, (bool, int, float, str)):  # subclasses (e.g. IntEnum) of the plain kinds
        return value
    return Opaque(repr(value))


def _args(values: Any, refs: dict[torch.fx.Node, NodeRef | int]) -> tuple[Arg, ...]:
    """``_arg`` of each of ``values``, a plain number or string taken as it is (a shape's ints)."""
    return tuple([v if type(v) in _PLAIN else _arg(v, refs) for v in values])


def _dim(d: Any) -> int | str:
    """A size: an int, the int a symbolic size is pinned to (``Dim.AUTO`` on a dim the model fixes
    leaves a SymInt of value 3), or the symbolic size's name."""
    if isinstance(d, torch.SymInt):
        pinned = d.node.maybe_as_int()
        return str(d) if pinned is None else int(pinned)
    return int(d) if isinstance(d, int) else str(d)


_SPECS: dict[tuple[torch.Size, torch.dtype], TensorSpec] = {}


def tensor_spec(value: Any, symbolic: dict[str, torch.SymInt] | None = None) -> TensorSpec | None:
    """Spec of a (fake) tensor, or None for anything else; ``symbolic`` collects its symbolic sizes
    by name."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return _SPECS[(value.shape, value.dtype)]
    except TypeError:  # symbolic sizes do not hash
        if symbolic is not None:
            sizes: tuple[Any, ...] = tuple(value.shape)  # torch.Size says int; these are SymInts
            symbolic.update((str(d), d) for d in sizes if isinstance(d, torch.SymInt) and d.node.maybe_as_int() is None)
        return TensorSpec(shape=tuple(_dim(d) for d in value.shape), dtype=dtype_name(value.dtype))
    except KeyError:
        spec = _SPECS[(value.shape, value.dtype)] = TensorSpec(
            shape=tuple(int(d) for d in value.shape), dtype=dtype_name(value.dtype)
        )
        return spec


def _spec(value: Any, symbolic: dict[str, torch.SymInt]) -> Spec:
    if isinstance(value, (list, tuple)):
        return tuple(tensor_spec(v, symbolic) for v in value)
    return tensor_spec(value, symbolic)


def _decomposed(ep: ExportedProgram | None) -> bool:
    """An aten ExportedProgram of Core ATen ops: its verifier's dialect is ``ATEN`` (after
    ``run_decompositions()``), not ``TRAINING`` (as ``torch.export.export`` makes it). A
    GraphModule does not say: not taken as one."""
    verifiers: list[Any] = list(getattr(ep, "verifiers", None) or [])
    return bool(verifiers) and getattr(verifiers[0], "dialect", None) == "ATEN"


def _least_sizes(
    ep: ExportedProgram | None, gm: torch.fx.GraphModule, symbolic: dict[str, torch.SymInt]
) -> dict[str, int]:
    """The least value of each symbolic size the program declares: an exported program's range
    constraints, and a data-dependent size's range (``inline_constraints`` of a GraphModule). The
    tracer's own ranges are no declaration: it assumes 2 or more for a size the program lets be 0."""
    declared = dict(ep.range_constraints) if ep is not None else dict(gm.meta.get("inline_constraints", {}))
    out: dict[str, int] = {}
    for name, d in symbolic.items():
        expr = d.node.expr
        if not expr.free_symbols <= declared.keys():
            continue
        try:
            low = bound_sympy(expr, declared).lower
        except Exception:  # sympy cannot bound it: not known to be 1 or more, which is safe
            continue
        if low.is_integer and low.is_finite:
            out[name] = int(low)
    return out


def _values(t: torch.Tensor) -> tuple[int | float, ...] | None:
    """A small integer vector's data, or a 0-d tensor's number (``ConstantInfo.values``); None for a
    tensor of no data (on the meta device, or fake: a program exported under ``FakeTensorMode``)."""
    dims, floating = t.dim(), t.is_floating_point()
    if dims > 1 or (dims == 1 and floating) or t.numel() > SMALL_VALUES or t.is_meta or t.is_complex():
        return None  # (a float vector: a bias, a norm's weight)
    if isinstance(t, FakeTensor):
        return None
    if not floating:
        return tuple(int(v) for v in t.reshape(-1).tolist())
    number = float(t.item()) if dims == 0 else None
    return (number,) if number is not None and number == number else None  # (NaN equals nothing)


def storage(t: torch.Tensor) -> str:
    """What identifies ``t``'s storage: tensors sharing one alias each other."""
    if t.is_meta:  # no data, no address: each meta tensor is its own storage
        return f"meta-{id(t):x}"
    if opaque(t):  # no storage of its own to read (torch raises)
        return f"opaque-{id(t):x}"
    return f"{t.untyped_storage().data_ptr():x}"


def opaque(t: torch.Tensor) -> bool:
    """A tensor that is not plain dense data: a sparse (or other non-strided) layout, a nested
    tensor, or a tensor subclass wrapping others (torchao's quantized weights, ``TwoTensor``). No
    rule reads it as a constant: its values are not what arithmetic on its elements would compute from."""
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter  # (no subclass: most weights)
    return t.layout is not torch.strided or t.is_nested or (not plain and is_traceable_wrapper_subclass(t))


@dataclass
class Captured:
    """A program with its snapshot and the live objects behind it (adapter-internal); the module
    calls and control-flow branches a rule cannot reach are kept to be reported."""

    program: Program
    gm: torch.fx.GraphModule
    snap: GraphSnapshot
    tensors: dict[str, torch.Tensor]
    specs: dict[str, InputSpec]
    module_calls: list[tuple[str, str, str]] = field(default_factory=list)  # node, canonical target, what it calls
    branches: list[tuple[str, torch.fx.GraphModule]] = field(default_factory=list)  # attribute, graph
    # node -> the module whose preserved call signature names it (preserve_module_call_signature)
    pinned: dict[str, str] = field(default_factory=dict)
    # each in-place write in the graph, in order: (the node that writes, the tensor it writes)
    writes: tuple[tuple[str, str], ...] = ()
    views: dict[str, str] = field(default_factory=dict)  # a view -> the tensor it views
    copies: frozenset[str] = frozenset()  # views that may be copies (``MAYBE_COPIES``), or of one
    # a node that may alias several tensors (``broadcast_tensors``) -> each of them (its own root)
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a symbolic_trace graph read as the ATen ops it calls, found once for every rule (``_traced``)
    traced: _Traced | None = field(default=None, repr=False, compare=False)


def _pinned(ep: ExportedProgram | None) -> dict[str, str]:
    """The nodes a preserved module call signature names as the module's inputs or outputs: they
    must stay in the graph for the program to validate (and unflatten)."""
    out: dict[str, str] = {}
    for entry in ep.module_call_graph if ep is not None else ():
        sig = entry.signature
        for arg in [*sig.inputs, *sig.outputs] if sig is not None else ():
            name = getattr(arg, "name", None)
            if isinstance(name, str):
                out.setdefault(name, entry.fqn)
    return out


def _tensor_of(ep: ExportedProgram, spec: InputSpec) -> torch.Tensor | None:
    target = spec.target
    if target is None:
        return None
    t = ep.state_dict.get(target)
    if t is None:
        t = ep.constants.get(target)
    return t if isinstance(t, torch.Tensor) else None


@dataclass
class _Fakes:
    """Values computed for calls torch added without ``meta["val"]``, and the program's fake mode
    they are computed in (looked up once; None for a program with no fake values at all)."""

    gm: torch.fx.GraphModule
    values: dict[torch.fx.Node, Any] = field(default_factory=dict)
    looked: bool = False
    mode: Any = None

    def fake_mode(self) -> Any:
        if not self.looked:
            from torch._guards import detect_fake_mode

            self.looked = True
            vals = (n.meta.get("val") for n in self.gm.graph.nodes)
            self.mode = detect_fake_mode([next((v for v in vals if isinstance(v, torch.Tensor)), None)])
        return self.mode


def _value_of(n: torch.fx.Node, fakes: _Fakes) -> Any:
    """The value of a call torch added without ``meta["val"]`` (``convert_pt2e``'s quantize and
    dequantize nodes, in the GraphModule it returns), computed on the fake values of what it reads
    (a constant's own tensor made fake in the program's mode); None where a read has none (a
    ``symbolic_trace`` module has none at all), or torch cannot compute it."""
    mode = fakes.fake_mode() if n.op == "call_function" else None
    if mode is None:
        return None
    reads = {a: a.meta.get("val", fakes.values.get(a)) for a in n.all_input_nodes}
    fn: Any = n.target
    try:
        for a, v in reads.items():
            t = _attr(fakes.gm, str(a.target)) if v is None and a.op == "get_attr" else None
            reads[a] = mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else v
        if any(v is None for v in reads.values()):
            return None
        with mode:
            value = fn(*torch.fx.node.map_arg(n.args, reads.get), **torch.fx.node.map_arg(n.kwargs, reads.get))
    except Exception:  # what torch cannot compute here has no spec, as before
        return None
    fakes.values[n] = value
    return value


def _attr(gm: torch.nn.Module, path: str) -> Any:
    obj: Any = gm
    for atom in path.split("."):
        obj = getattr(obj, atom, None)
    return obj


def _constant(
    ep: ExportedProgram | None, n: torch.fx.Node, value: Any, specs: dict[str, InputSpec]
) -> tuple[torch.Tensor, ConstantKind, str] | None:
    """The tensor behind a lifted placeholder or a get_attr node (``value``: its attribute), with
    its kind and key."""
    spec = specs.get(n.name) if n.op == "placeholder" and ep is not None else None
    kind = _KINDS.get(spec.kind) if spec is not None else None
    if ep is not None and spec is not None and kind is not None:
        t = _tensor_of(ep, spec)
        return (t, kind, spec.target or n.name) if t is not None else None
    if isinstance(value, torch.Tensor):
        return value, "parameter" if isinstance(value, torch.nn.Parameter) else "buffer", str(n.target)
    return None


_EMPTY: PMap[str, Arg] = pmap()


# what torch.fx's generated code names besides the graph's nodes (builtins, keywords, its own globals)
_CODE_NAMES = (*getattr(torch.fx.graph, "_illegal_names", {}), *getattr(torch.fx.graph, "_custom_builtins", {}))


def _reserved(ep: ExportedProgram | None, gm: torch.fx.GraphModule) -> frozenset[str]:
    """Names a new node or constant must not take: every state-dict / constant key and attribute of
    the module, every module the program calls, with each dotted prefix (a submodule's name), and
    the names the generated code and ``ep.module()`` use (``self``, builtins, ``torch``, ``_guards_fn``)."""
    keys = [*ep.state_dict, *ep.constants, *(e.fqn for e in ep.module_call_graph)] if ep is not None else []
    keys += ["self", "_guards_fn", *_CODE_NAMES]
    keys += [k for k, _ in gm.named_parameters(remove_duplicate=False)]
    keys += [k for k, _ in gm.named_buffers(remove_duplicate=False)]
    keys += [k for k, _ in gm.named_modules(remove_duplicate=False)]
    prefixes: set[str] = set()
    for k in keys:  # each dotted prefix, up to one found already (whose own prefixes are in)
        while "." in k and (k := k.rsplit(".", 1)[0]) not in prefixes:
            prefixes.add(k)
    return frozenset(keys) | prefixes | frozenset(dir(gm))


def capture_program(program: Program) -> Captured:
    """Snapshot a program and keep the live tensors and input specs beside it (with the cyclic
    collector paused, as ``plan`` does: a snapshot is many small records that form no cycles)."""
    with no_cyclic_gc(keep=True):
        return _capture(program)


_ALIASES: dict[Any, tuple[bool, tuple[tuple[int, str, bool], ...]]] = {}
_NOT_DATA_WRITES = frozenset({"detach_", "requires_grad_", "retain_grad"})


def aliases(target: Any) -> tuple[bool, tuple[tuple[int, str, bool], ...]]:
    """Whether ``target`` returns an alias of an argument, and its aliased arguments as (position,
    or -1 if keyword-only; name; written in place), from its schema (none without one)."""
    try:
        return _ALIASES[target]
    except KeyError:
        pass
    schema = getattr(target, "_schema", None)
    found: tuple[bool, tuple[tuple[int, str, bool], ...]] = (False, ())
    if isinstance(schema, torch.FunctionSchema) and undeclared_alias(target):
        # the tensor it is given (the first; every one, for an op of several), none written
        tensors = [a for a in schema.arguments if "Tensor" in str(a.type)]
        some = tensors if schema.name in _ALIASES_ALL else tensors[:1]
        found = (True, tuple((-1 if a.kwarg_only else schema.arguments.index(a), a.name, False) for a in some))
    elif isinstance(schema, torch.FunctionSchema):
        args = tuple(
            (-1 if a.kwarg_only else i, a.name, bool(a.alias_info.is_write))
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None
        )
        # ``detach_`` (export reads a tensor made in forward through ``lift_fresh_copy`` and it),
        # ``requires_grad_`` and ``retain_grad`` write autograd's metadata, not the data: no write
        writes = schema.name.removeprefix("aten::") not in _NOT_DATA_WRITES
        args = tuple((i, name, write and writes) for i, name, write in args)
        found = (any(r.alias_info is not None for r in schema.returns), args)
    _ALIASES[target] = found
    return found


# ops whose schema says they return a new tensor that may return one they are given, or a view of
# it (their composite kernel does: ``dropout`` in eval mode, ``type_as`` of the same dtype,
# ``einsum("ij->ij", x)``, ``x.sum_to_size(x.shape)``, ``unsafe_split``): those torch tags
# ``maybe_aliasing_or_mutating`` (but the batch norms, tagged for the running stats they update,
# which ``_updated_stats`` reads), and these
_UNDECLARED_ALIASES = frozenset(
    f"aten::{op}"
    for op in (
        "type_as",
        "broadcast_tensors",
        "meshgrid",
        "einsum",
        "sum_to_size",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "native_channel_shuffle",
        "channel_shuffle",
        "to_dense",
        "flatten_dense_tensors",
    )
)
_UPDATES_STATS = frozenset({"aten::batch_norm", "aten::_batch_norm_impl_index"})
# of those, the ops that may return (views of) any of the tensors they are given, not only the first
_ALIASES_ALL = frozenset(
    f"aten::{op}" for op in ("broadcast_tensors", "meshgrid", "einsum", "cartesian_prod", "flatten_dense_tensors")
)
# and those whose result is a view or a copy by their input's strides (a reshape inside)
_RESHAPES_INSIDE = frozenset({"aten::native_channel_shuffle", "aten::channel_shuffle"})


def undeclared_alias(target: Any) -> bool:
    """Whether ``target`` may return one of the tensors it is given (or a view of one), or a new
    one, whatever its schema says: it counts as a view of it (of each, for ``_ALIASES_ALL``), a
    write through it a write of that tensor (whether it is a new one depends on the mode, the
    dtype or the sizes, not the strides: no copy but for ``_RESHAPES_INSIDE``)."""
    schema = getattr(target, "_schema", None)
    if not isinstance(schema, torch.FunctionSchema):
        return False
    tagged = torch.Tag.maybe_aliasing_or_mutating in getattr(target, "tags", ())
    return schema.name in _UNDECLARED_ALIASES or (tagged and schema.name not in _UPDATES_STATS)


@dataclass
class _Writes:
    """What a program writes: the tensors (as the node whose tensor it is, through any views), and
    each write in the graph, as (the node that writes, the tensor it writes), in graph order."""

    written: set[str] = field(default_factory=set)
    signature: set[str] = field(default_factory=set)  # of those, what the signature writes, after the graph
    events: list[tuple[str, str]] = field(default_factory=list)
    views: dict[str, str] = field(default_factory=dict)  # a view -> the tensor it views
    copies: set[str] = field(default_factory=set)  # views that may be copies (MAYBE_COPIES), or of one
    # a node that may alias several tensors (``broadcast_tensors``) -> each of them: its own root,
    # a write to it a write to each
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def write(self, node: str, value: str) -> None:
        todo, seen = [self.views.get(value, value)], set()
        while todo:
            root = todo.pop()
            if root not in seen:
                seen.add(root)
                self.written.add(root)
                self.events.append((node, root))
                todo.extend(self.shared.get(root, ()))

    def view(self, node: str, of: str) -> None:
        """``node`` is a view of ``of`` (so of the tensor ``of`` views)."""
        self.views[node] = self.views.get(of, of)


def _writes(ep: ExportedProgram | None, gm: torch.fx.GraphModule) -> _Writes:
    """The buffers, parameters and inputs a program's signature mutates, and each tensor an in-place op (or
    an ``out=``) writes, traced back through the views it was taken of."""
    w = _Writes()
    if ep is not None:
        signature = ep.graph_signature
        mutated = {*signature.buffers_to_mutate.values(), *signature.parameters_to_mutate.values()}
        w.signature |= {
            s.arg.name for s in ep.graph_signature.input_specs if s.target in mutated and hasattr(s.arg, "name")
        }
        w.signature |= set(signature.user_inputs_to_mutate.values())  # (by their placeholders' names)
        w.written |= w.signature
    views = w.views
    attrs: dict[str, list[str]] = {}  # a get_attr target -> its nodes (a module's buffers it updates)
    for n in gm.graph.find_nodes(op="get_attr"):
        attrs.setdefault(str(n.target), []).append(n.name)
    plain = _NO_WRITES
    # whether a call_function target is ``plain``, by its id (the graph holds each alive, and an op's
    # hash is Python code)
    skip: dict[int, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            _module_writes(w, gm, n, attrs)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        if n.op == "call_function":
            known = skip.get(id(n.target))
            if known is None:
                try:
                    known = skip[id(n.target)] = plain.get(n.target, False)
                except TypeError:  # an unhashable target (aliases below says why it is skipped)
                    known = skip[id(n.target)] = False
            if known:
                continue
        target = n.target if n.op == "call_function" else _method(str(n.target))
        # an edge op holds the aten op it stands for (its own schema is no torch.FunctionSchema)
        target = aten if isinstance(aten := getattr(target, "_op", None), torch._ops.OpOverload) else target
        if isinstance(target, torch._ops.HigherOrderOperator):
            if _branches_write(gm, n):  # ``with torch.no_grad(): buf.add_(1)`` writes what it is given
                for x in n.all_input_nodes:
                    w.write(n.name, x.name)
            continue
        if n.target is operator.getitem:  # an element of a split, unbind, chunk, or of a tensor: a view too
            x = n.args[0]
            if isinstance(x, torch.fx.Node) and x.name in views:
                views[n.name] = views[x.name]
                if x.name in w.copies:  # an element of what may be a copy (``unsafe_split``'s)
                    w.copies.add(n.name)
            elif isinstance(x, torch.fx.Node) and x.name in w.shared:  # an element of ``broadcast_tensors``
                views[n.name] = x.name
            elif isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                views[n.name] = x.name  # ``g[0]``, ``g[:, 1]`` (an index by tensor or list copies)
                if any(isinstance(i, (torch.fx.Node, list)) for i in _flat(n.args[1])):
                    w.copies.add(n.name)
            continue
        if not isinstance(getattr(target, "_schema", None), torch.FunctionSchema):  # a Python-level call
            _python_writes(w, n)
            continue
        try:
            returns_alias, args = aliases(target)
        except TypeError:  # an unhashable target: no schema to read
            continue
        if not returns_alias and not args and n.op == "call_function" and not _updated_stats(n, target):
            # nothing read is aliased or written (a batch norm's mode is per node: it is never plain)
            with contextlib.suppress(TypeError):
                plain[n.target] = skip[id(n.target)] = _STATS[target] is None
            continue
        unchanged = bool(args) and _idle(n, target)
        viewed: list[str] = []
        for i, name, write in (*args, *_updated_stats(n, target)):
            write = write and not unchanged
            value = n.args[i] if 0 <= i < len(n.args) else n.kwargs.get(name)
            for x in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(x, torch.fx.Node):
                    if write:
                        w.write(n.name, x.name)
                    if returns_alias:  # a view, or an in-place op's result: the tensor it was given
                        viewed.append(x.name)
        # (a view of one that may be a copy may be one too)
        _view_of(w, n.name, viewed, bool(viewed) and (may_copy(target) or any(x in w.copies for x in viewed)))
    return w


def _view_of(w: _Writes, node: str, given: list[str], copy: bool) -> None:
    """Record ``node`` as a view of the tensor ``given`` names (may it be a copy: ``copy``), or of
    each of several (``broadcast_tensors([x, z])``: a node of its own, in ``shared``)."""
    roots = tuple(dict.fromkeys(w.views.get(x, x) for x in given)) if len(given) > 1 else tuple(given)
    if len(roots) == 1:
        w.view(node, given[0])
    elif roots:
        w.shared[node] = roots
    if copy and roots:
        w.copies.add(node)


# in-place dropouts, which leave their input as it is in eval mode (``train=False``)
_DROPOUTS_ = frozenset(
    f"aten::{op}_" for op in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")
)


def _idle(n: torch.fx.Node, target: Any) -> bool:
    """Whether the in-place op at ``n`` writes nothing: a dropout in eval mode (MobileNet's classifier
    holds ``nn.Dropout(inplace=True)``)."""
    if target._schema.name not in _DROPOUTS_:
        return False
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
    return train is False


# a call of no aten op that writes its first argument: ``x[0] = 1``, ``x *= 2`` in a traced graph
_SETS = frozenset(
    getattr(operator, f"i{op}")
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
) | {operator.setitem, operator.imatmul}
# and its spelling as a method call: ``x.__iadd__(v)``, ``x.__setitem__(i, v)``
_SET_METHODS = frozenset(f"__{f.__name__}__" for f in _SETS)
# attributes of a tensor that are views of it (``w.data``, ``w.mT``)
_VIEW_ATTRS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# methods of no aten op of the same name that return the tensor itself when it already has the dtype
_CASTS = frozenset({"float", "half", "double", "bfloat16", "int", "long", "short", "bool", "byte", "char", "type"})


def _flat(value: Any) -> list[Any]:
    return [y for x in value for y in _flat(x)] if isinstance(value, (list, tuple)) else [value]


def _python_writes(w: _Writes, n: torch.fx.Node) -> None:
    """What a call of no aten op (a torch function, an operator, a method of no aten op of its name,
    in a symbolic_trace graph) writes and aliases, as far as its name and arguments tell: in place
    by name (``torch.relu_``, ``torch.Tensor.mul_``), ``x[i] = v`` and ``x *= v`` (also spelled
    ``x.__imul__(v)``), ``inplace=True``,
    ``out=``, a norm in training mode; ``w.data``, ``w.mT`` and ``w.float()`` are views of ``w``."""
    x = n.args[0] if n.args else None
    first = x if isinstance(x, torch.fx.Node) else None
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    if first is not None and n.op == "call_function" and n.target is getattr and n.args[1] in _VIEW_ATTRS:
        w.view(n.name, first.name)
        return
    if first is not None and n.op == "call_method" and name in _CASTS:
        w.view(n.name, first.name)
        w.copies.add(n.name)  # a copy when the dtype changes
        return
    bound = _bound(n)
    if first is not None and n.target in _DROPOUT_FUNCTIONS and bound.get("training", bound.get("train")) is False:
        w.view(n.name, first.name)  # ``F.dropout(x, training=False)`` returns x (and writes nothing)
        return
    # a torch function of an aten op's name that returns (a view of) a tensor it is given, declared
    # or not: ``torch.flatten(x)``, ``torch.broadcast_tensors(z, x)``, ``torch.dropout(x, p, False)``
    op = _method(name) if n.op == "call_function" and name and getattr(torch, name, None) is n.target else None
    if op is not None and aliases(op)[0]:
        given = [a.name for a in _flat([*n.args, *n.kwargs.values()]) if isinstance(a, torch.fx.Node)]
        _view_of(w, n.name, given if op._schema.name in _ALIASES_ALL else given[:1], may_copy(op))
    in_place = name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA_WRITES
    if first is not None and (
        in_place or n.target in _SETS or name in _SET_METHODS or bound.get("inplace", n.kwargs.get("inplace")) is True
    ):
        w.write(n.name, first.name)
        w.view(n.name, first.name)
    for out in _flat(n.kwargs.get("out")):
        if isinstance(out, torch.fx.Node):
            w.write(n.name, out.name)
    if any(bound.get(f) not in (None, False) for f in _STATS_FLAGS):  # F.batch_norm(..., training=True)
        for stats in (bound.get(k) for k in _STATS_ARGS):
            if isinstance(stats, torch.fx.Node):
                w.write(n.name, stats.name)


# the dropouts of torch.nn.functional, which return their input when not training (torch's own,
# builtins of the aten ops' names, are read as those ops: ``_python_writes``)
_DROPOUT_FUNCTIONS = frozenset(
    getattr(torch.nn.functional, f)
    for f in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
)


def _bound(n: torch.fx.Node) -> dict[str, Any]:
    """A Python-level function call's arguments by parameter name ({} if its signature is unknown)."""
    import inspect

    if n.op != "call_function" or not callable(n.target):
        return {}
    try:
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
    except (TypeError, ValueError):  # no signature, or not these arguments
        return {}
    bound.apply_defaults()  # (F.instance_norm uses its input's stats unless told not to)
    return dict(bound.arguments)


def _module_writes(w: _Writes, gm: torch.fx.GraphModule, n: torch.fx.Node, attrs: dict[str, list[str]]) -> None:
    """What a module call of a symbolic_trace graph writes: its input, for ``nn.ReLU(inplace=True)``
    and its like (not a dropout in eval mode, which returns it: a view of it); the running stats a batch norm in
    training mode updates, where the graph reads them too; and, so far as anyone knows, every tensor
    it is given, for a module of no ``torch.nn`` type (a custom tracer's leaf runs any code)."""
    module, x = _attr(gm, str(n.target)), n.args[0] if n.args else None
    if (type(module).__module__, type(module).__name__) == ("torch.export._unlift", "GuardsFn"):
        return  # the shape guards ``ExportedProgram.module()`` checks its inputs against: it reads them
    if not type(module).__module__.startswith("torch.nn."):
        for given in n.all_input_nodes:
            w.write(n.name, given.name)
        return
    dropout = isinstance(module, torch.nn.modules.dropout._DropoutNd) and not module.training
    if dropout and isinstance(x, torch.fx.Node):  # it returns its input
        w.view(n.name, x.name)
    elif getattr(module, "inplace", False) is True and isinstance(x, torch.fx.Node):
        w.write(n.name, x.name)
        w.view(n.name, x.name)
    if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.training:
        for stat in _STATS_ARGS:
            for name in attrs.get(f"{n.target}.{stat}", ()):
                w.write(n.name, name)


def _method(name: str) -> torch._ops.OpOverload | None:
    """The aten op a tensor method of a symbolic_trace graph calls (``x.mul_(2)``: ``aten.mul_``),
    as one of its overloads: they alias and write alike, self first, as the method's arguments."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    overloads: list[str] = packet.overloads()  # type: ignore[no-untyped-call]
    return getattr(packet, "default" if "default" in overloads else overloads[0]) if overloads else None


# call_function targets (as the graph holds them) whose calls alias and write nothing: most ops
_NO_WRITES: dict[Any, bool] = {}
_STATS: dict[Any, tuple[tuple[str, int], tuple[tuple[int, str, bool], ...]] | None] = {}
# a norm that updates its running stats in place when it computes batch statistics, without its
# schema saying so (``aten.batch_norm``, ``native_batch_norm``, ``instance_norm``): the flag that
# says it does, and the stats
_STATS_FLAGS = ("training", "use_input_stats")
_STATS_ARGS = ("running_mean", "running_var")


def _updated_stats(n: torch.fx.Node, target: Any) -> tuple[tuple[int, str, bool], ...]:
    """The running stats ``n`` (calling ``target``) writes, as ``aliases`` gives written arguments:
    those of a norm in training mode (or one whose mode is not a literal) that its schema does not
    mark written."""
    if target not in _STATS:  # (the caller read the schema of this hashable target already)
        named = {a.name: (i, a) for i, a in enumerate(target._schema.arguments)}
        mode = next(((f, named[f][0]) for f in _STATS_FLAGS if f in named), None)
        stats = tuple((named[k][0], k, True) for k in _STATS_ARGS if k in named and named[k][1].alias_info is None)
        _STATS[target] = (mode, stats) if mode is not None and stats else None
    found = _STATS[target]
    if found is None:
        return ()
    (flag, at), stats = found
    on = n.args[at] if at < len(n.args) else n.kwargs.get(flag)
    return () if on is False else stats


# ops whose schema returns an alias of their input that return a copy when the input's strides (or
# dtype) call for one: ``x.t().contiguous()`` is a new tensor, ``x.contiguous()`` is ``x``
MAYBE_COPIES = frozenset(
    f"aten::{op}"
    for op in ("reshape", "reshape_as", "contiguous", "flatten", "ravel", "to", "resolve_conj", "resolve_neg")
)


def may_copy(target: Any) -> bool:
    """Whether ``target``'s result, which its schema says aliases its input, may be a copy."""
    schema = getattr(target, "_schema", None)
    return isinstance(schema, torch.FunctionSchema) and (schema.name in MAYBE_COPIES or schema.name in _RESHAPES_INSIDE)


def _branches_write(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """Whether a higher-order op may write its operands: one of its graphs writes a tensor (cond,
    map and while_loop take none that do), or it runs code that is not a graph (a delegate)."""
    graphs = [_attr(gm, str(a.target)) for a in n.all_input_nodes if a.op == "get_attr"]
    graphs = [g for g in graphs if isinstance(g, torch.nn.Module)]
    if not graphs or not all(isinstance(g, torch.fx.GraphModule) for g in graphs):
        return True
    return any(_writes(None, g).written for g in graphs)


def _capture(program: Program) -> Captured:
    ep = program if isinstance(program, ExportedProgram) else None
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expected an ExportedProgram or a torch.fx.GraphModule, got {type(program).__name__}")
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")} if ep else {}
    placeholders = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    lost = next((k for k in specs if k not in placeholders), None)
    if lost is not None:  # torch's own validate() fails too: nothing here can be applied
        raise TypeError(
            f"the program's graph signature names input {lost!r}, which its graph does not have (a copy.deepcopy"
            " of an exported program renames an input named like a builtin, 'input', without its signature):"
            " transform the program itself, or export it again"
        )
    nodes: list[NodeSnapshot] = []
    constants: dict[str, ConstantInfo] = {}
    tensors: dict[str, torch.Tensor] = {}
    calls: list[tuple[str, str, str]] = []
    branches: list[tuple[str, torch.fx.GraphModule]] = []
    refs: dict[torch.fx.Node, NodeRef | int] = {}
    symbolic: dict[str, torch.SymInt] = {}
    held_opaque: list[str] = []
    fakes = _Fakes(gm)  # values of calls torch added without one
    targets: dict[int, tuple[str, bool, str | None]] = {}  # id of a call_function target -> _called's
    edge = False
    for n in gm.graph.nodes:
        name, op = n.name, n.op
        spec: Spec = None
        if op == "call_function":
            # what is read of the target, once per target (by id: the graph holds each alive, and an
            # op's hash is Python code)
            called = targets.get(id(n.target))
            if called is None:
                called = targets[id(n.target)] = _called(n.target)
            target, edge_op, function_op = called
            edge = edge or edge_op
            if function_op is not None:
                calls.append((name, function_op, f"the function {function_op.split('.')[1]}"))
        else:
            target = str(n.target)
            value = _attr(gm, target) if op == "get_attr" else None
            if op == "call_module":
                calls.extend(_module_call(gm, n))
            elif isinstance(value, torch.fx.GraphModule):
                branches.append((target, value))
            found = _constant(ep, n, value, specs) if op in ("placeholder", "get_attr") else None
            if found is not None and opaque(found[0]):  # held by the program, but no data to fold
                held_opaque.append(name)
            elif found is not None:
                t, kind, key = found
                spec = tensor_spec(t)  # also the node's where torch gave it none (``convert_pt2e``'s)
                assert spec is not None
                constants[name] = ConstantInfo(kind=kind, key=key, spec=spec, storage=storage(t), values=_values(t))
                tensors[name] = t
        kwargs = n.kwargs
        nodes.append(
            NodeSnapshot(
                name=name,
                op=op,
                target=target,
                args=_args(n.args, refs),
                kwargs=pmap({k: _arg(v, refs) for k, v in kwargs.items()}) if kwargs else _EMPTY,
                spec=_spec(v, symbolic)
                if (v := n.meta.get("val")) is not None
                else spec or _spec(_value_of(n, fakes), symbolic),
            )
        )
        # size arithmetic export found constant (a conv_transpose's output_padding of output_size=, say):
        # its readers read the number
        if op == "call_function" and not isinstance(v, torch.Tensor) and (known := known_int(v)) is not None:
            refs[n] = known
    writes = _writes(ep, gm)
    # and every view of one the signature writes, after the graph: the view then holds the written
    # value (an output moved to it returns that, fxpure.plan.returns_written; a write in the graph
    # is ordered against the reads by the adapter's checks)
    written = writes.written | {
        v
        for v, of in (*writes.views.items(), *((v, x) for v, xs in writes.shared.items() for x in xs))
        if of in writes.signature
    }
    if written:  # a tensor the program writes (or one sharing its storage) is no constant to fold
        storages = {constants[k].storage for k in written if k in constants}
        for k in [k for k, c in constants.items() if k in written or c.storage in storages]:
            del constants[k], tensors[k]
    snap = snapshot(
        nodes,
        constants,
        dialect="edge" if edge else "aten",
        lifted=ep is not None,
        decomposed=_decomposed(ep),
        reserved=_reserved(ep, gm),
        least_sizes=_least_sizes(ep, gm, symbolic) if symbolic else None,
        written=written,
        opaque=held_opaque,
    )
    return Captured(
        program,
        gm,
        snap,
        tensors,
        specs,
        calls,
        branches,
        _pinned(ep),
        tuple(writes.events),
        writes.views,
        frozenset(writes.copies),
        writes.shared,
    )


LINEAR_CALL = "aten.linear.default"
# modules whose calls (in a symbolic_trace GraphModule) stand for an ATen op a rule may anchor on
_MODULE_OPS: tuple[tuple[type[torch.nn.Module], str], ...] = (
    (torch.nn.ConvTranspose1d, "aten.conv_transpose1d.default"),
    (torch.nn.ConvTranspose2d, "aten.conv_transpose2d.input"),
    (torch.nn.ConvTranspose3d, "aten.conv_transpose3d.input"),
    (torch.nn.Conv1d, "aten.conv1d.default"),
    (torch.nn.Conv2d, "aten.conv2d.default"),
    (torch.nn.Conv3d, "aten.conv3d.default"),
    (torch.nn.modules.batchnorm._BatchNorm, "aten.batch_norm.default"),
    (torch.nn.Linear, LINEAR_CALL),
    (torch.nn.ReLU, "aten.relu.default"),
    # modules that pass their input on in eval mode, as the ATen ops a rule reads through (``idle``)
    (torch.nn.modules.dropout._DropoutNd, "aten.dropout.default"),
    (torch.nn.Identity, "aten.clone.default"),
)
_PASSES = frozenset({"aten.dropout.default", "aten.clone.default"})


def _module_call(gm: torch.fx.GraphModule, n: torch.fx.Node) -> list[tuple[str, str, str]]:
    module = _attr(gm, str(n.target))
    found = next((t for cls, t in _MODULE_OPS if isinstance(module, cls)), None)
    return [(n.name, found, f"an nn.{type(module).__name__} module")] if found is not None else []


# torch functions (and ATen op packets, of no overload) a symbolic_trace GraphModule calls for an ATen
# op a rule may anchor on: ``F.conv2d(x, w)``, ``torch.ops.aten.conv2d(...)``
_FUNCTION_OPS: dict[object, str] = {
    **{f: f"aten.conv{d}d.default" for d in (1, 2, 3) for f in (getattr(torch, f"conv{d}d"),)},
    torch.conv_transpose1d: "aten.conv_transpose1d.default",
    torch.conv_transpose2d: "aten.conv_transpose2d.input",
    torch.conv_transpose3d: "aten.conv_transpose3d.input",
    torch.nn.functional.batch_norm: "aten.batch_norm.default",
    torch.batch_norm: "aten.batch_norm.default",
    torch.nn.functional.linear: "aten.linear.default",
    **{getattr(torch.ops.aten, op): f"aten.{op}.default" for op in ("conv1d", "conv2d", "conv3d", "linear")},
    torch.ops.aten.batch_norm: "aten.batch_norm.default",
}


def _called(target: Any) -> tuple[str, bool, str | None]:
    """A call_function target's canonical name, whether it is an edge op, and the ATen op a call of
    it in a symbolic_trace GraphModule stands for (:data:`_FUNCTION_OPS`), if any."""
    try:
        found = _FUNCTION_OPS.get(target)
    except TypeError:  # a target that cannot be hashed
        found = None
    return target_name(target), is_edge(target), found


# arithmetic on a value as a symbolic_trace graph holds it, by (op, target): Python's (``self.conv(x) *
# 2.0``, ``y *= c``), torch's functions (``torch.mul(y, c)``, ``torch.add(y, c, alpha=2)``) and a
# tensor's methods (``y.mul_(c)``; ``c * y`` of a tensor attribute ``c`` is ``c.mul(y)``)
_ARITHMETIC = (("mul", "mul"), ("add", "add"), ("sub", "sub"), ("div", "div"), ("true_divide", "div"), ("rsub", "rsub"))
_OPERATORS = {
    **{
        ("call_function", f"_operator.{op}"): f"aten.{aten}.Tensor"
        for op, aten in (("mul", "mul"), ("add", "add"), ("sub", "sub"), ("truediv", "div"))
    },
    **{
        ("call_function", f"_operator.i{op}"): f"aten.{aten}_.Tensor"
        for op, aten in (("mul", "mul"), ("add", "add"), ("sub", "sub"), ("truediv", "div"))
    },
    **{("call_function", f"torch._VariableFunctionsClass.{op}"): f"aten.{aten}.Tensor" for op, aten in _ARITHMETIC},
    **{("call_method", op): f"aten.{aten}.Tensor" for op, aten in _ARITHMETIC},
    **{("call_method", f"{op}_"): f"aten.{op}_.Tensor" for op in ("mul", "add", "sub", "div")},
    ("call_function", "_operator.matmul"): "aten.matmul.default",
}
# a tensor's attributes that are ATen ops of it (``x @ w.T``)
_ATTRIBUTES = {"T": "aten.numpy_T.default", "mT": "aten.mT.default", "mH": "aten.mH.default", "H": "aten.mH.default"}


def _generic_modules(cap: Captured) -> dict[str, tuple[str, dict[str, Arg]]]:
    """The calls of ``torch.nn`` modules outside :data:`_MODULE_OPS` that name an ATen op, as that
    op with the module's settings (:func:`_module_as_aten`), by node."""
    fixed = {name for name, _, _ in cap.module_calls}
    out = {}
    for n in cap.snap.nodes:
        found = _module_as_aten(_attr(cap.gm, n.target)) if n.op == "call_module" and n.name not in fixed else None
        if found is not None:
            out[n.name] = found
    return out


def _as_aten(cap: Captured, settings: Mapping[str, tuple[str, dict[str, Arg]]]) -> GraphSnapshot:
    """``cap``'s snapshot with each module (or function) call spelled as the ATen op it stands for
    (the modules of ``settings`` with them, :func:`_generic_modules`), and Python's arithmetic as
    ATen's: what a rule would find were the model exported."""
    targets = {name: target for name, target, _ in cap.module_calls}
    # (not the size arithmetic of an exported graph: ``x.shape[0] * 2``'s value is a number)
    sizes = {
        n.name
        for n in cap.gm.graph.nodes
        if n.op == "call_function" and "val" in n.meta and not isinstance(n.meta["val"], torch.Tensor)
    }
    functions = {n.name: n.target for n in cap.gm.graph.nodes if n.op == "call_function"}
    nodes: list[NodeSnapshot] = []
    constants = dict(cap.snap.constants.items())
    for n in cap.snap.nodes:
        # (the one input of a linear module's call: ``self.fc(x)`` or ``self.fc(input=x)``)
        x = n.args[0] if len(n.args) == 1 and not n.kwargs else n.kwargs.get("input") if len(n.kwargs) == 1 else None
        if n.op == "call_module" and targets.get(n.name) not in (None, *_PASSES) and x is not None:
            nodes.extend(_module_op(cap, n, targets[n.name], x, constants))
        elif n.name in targets and targets[n.name] in _PASSES and x is not None:  # (``self.drop(input=y)`` too)
            module = _attr(cap.gm, n.target)  # (a dropout's rate and mode, as F.dropout is given them)
            passed: tuple[Arg, ...] = (
                (x, float(getattr(module, "p", 0.5)), bool(module.training))
                if targets[n.name] == "aten.dropout.default"
                else (x,)
            )
            nodes.append(replace(n, op="call_function", target=targets[n.name], args=passed, kwargs=_EMPTY))
        elif n.name in targets:
            target = _overload(targets[n.name], n.args[4] if len(n.args) > 4 else n.kwargs.get("padding"))
            named = _named_as(functions.get(n.name), target, n)  # (``F.batch_norm``)
            nodes.append(replace(n, op="call_function", target=target, **_by(named)))
        elif n.name in settings and len(n.args) == 1 and not n.kwargs:  # (its one input, and its settings)
            target, setting = settings[n.name]
            nodes.append(replace(n, op="call_function", target=target, kwargs=pmap(setting)))
        elif n.name not in sizes and (aten := _arithmetic(n)) is not None:
            # (torch's functions name the first operand ``input``: ``torch.mul(input=y, other=c)``)
            given = pmap({"self" if k == "input" else k: v for k, v in n.kwargs.items()}) if n.kwargs else _EMPTY
            named = _named_as(functions.get(n.name), aten, n)  # (``F.dropout(x, p, training)``)
            if n.target == "builtins.getattr":  # (``w.T``: of the tensor alone)
                named = (n.args[:1], _EMPTY)
            elif n.op == "call_method" and _listed(aten) and _one_by_one(n.args):
                named = ((n.args[0], n.args[1:]), given)  # (``w.permute(1, 0)``, ``y.view(-1)``: the op's list)
            nodes.append(replace(n, op="call_function", target=aten, **_by(named, given)))
        else:
            nodes.append(n)
    snap = cap.snap
    return snapshot(nodes, constants, dialect=snap.dialect, lifted=snap.lifted, decomposed=snap.decomposed)


# what a module of :data:`_MODULE_OPS` gives its op that it holds no attribute of
_GIVEN: Mapping[str, Callable[[], Arg]] = {"cudnn_enabled": lambda: bool(torch.backends.cudnn.enabled)}


def _module_op(
    cap: Captured, n: NodeSnapshot, target: str, x: Arg, constants: dict[str, ConstantInfo]
) -> list[NodeSnapshot]:
    """The call ``n`` of a module of :data:`_MODULE_OPS` on its one input ``x`` as the ATen op
    ``target``, preceded by the module's tensors as constants it reads, as an exported op reads them
    (a rule grouping linears by their input needs to see them as linears), its settings as the
    op's arguments (a conv's ``groups``: a rule for grouped convs takes no other one for a
    candidate); the op of its input alone where the module has no value for an argument. A conv
    module's padding as its call gives it: a string of the op's ``padding`` overload (``'same'``),
    none where the module pads its input first (``padding_mode='reflect'``)."""
    module = _attr(cap.gm, n.target)
    padded = getattr(module, "padding_mode", "zeros") != "zeros"
    target = _overload(target, None if padded else getattr(module, "padding", None))
    args, made = [x], []
    for param, value in _held(module, target):
        value = 0 if padded and param.name == "padding" else value
        if isinstance(value, torch.Tensor) and (spec := tensor_spec(value)) is not None:
            name = f"{n.name}.{param.name}"  # (no node has a dot in its name)
            made.append(NodeSnapshot(name=name, op="get_attr", target=f"{n.target}.{param.name}", spec=spec))
            constants[name] = ConstantInfo(kind="parameter", key=f"{n.target}.{param.name}", spec=spec)
            args.append(NodeRef(name))
        elif value is not None and not isinstance(value, torch.Tensor):
            args.append(_arg(value, {}))
        elif param.has_default_value() or isinstance(param.type, torch.OptionalType):
            args.append(_arg(param.default_value, {}) if param.has_default_value() else None)
        else:
            return [replace(n, op="call_function", target=target)]
    return [*made, replace(n, op="call_function", target=target, args=tuple(args), kwargs=_EMPTY)]


def _overload(target: str, padding: object) -> str:
    """A conv's ``target`` given a string for its padding: the op's ``padding`` overload, as export
    writes it (``aten.conv2d.padding`` for ``padding='same'``); else ``target``."""
    conv = target.startswith("aten.conv") and "transpose" not in target
    return target.replace(".default", ".padding") if conv and isinstance(padding, str) else target


def _held(module: object, target: str) -> Iterator[tuple[Any, object]]:
    """Each argument of the ATen op ``target`` after its input, with what ``module`` holds of it:
    its attribute of the argument's name, else what torch gives the op (:data:`_GIVEN`), else None."""
    _, op, overload = target.split(".")
    for param in getattr(getattr(torch.ops.aten, op), overload)._schema.arguments[1:]:
        value = getattr(module, param.name, None)
        yield param, _GIVEN[param.name]() if value is None and param.name in _GIVEN else value


def _named_as(function: object, target: str, n: NodeSnapshot) -> tuple[tuple[Arg, ...], PMap[str, Arg]] | None:
    """The arguments of ``n``, a call of a Python function of ``torch.nn.functional``, as the ATen op
    ``target`` takes them, positional as export writes them (``F.batch_norm(input, running_mean,
    running_var, ...)``; ``F.dropout``'s ``training`` as ``train``, its ``inplace`` no argument of
    the op); None for any other function, or where the op needs an argument it is not given."""
    if getattr(function, "__module__", None) != "torch.nn.functional" or not inspect.isfunction(function):
        return None
    try:
        given = inspect.signature(function).bind(*n.args, **n.kwargs).arguments
    except TypeError:
        return None
    _, op, overload = target.split(".")
    params = getattr(getattr(torch.ops.aten, op), overload)._schema.arguments
    names = {p.name for p in params}
    by_name: dict[str, Arg] = {}
    for i, (name, value) in enumerate(given.items()):
        name = params[0].name if i == 0 else name if name in names else _RENAMED.get(name, name)
        if name in names:
            by_name[name] = value
    args: list[Arg] = []
    kwargs: dict[str, Arg] = {}
    for p in params:
        if p.name in by_name:
            value = by_name[p.name]
        elif p.name in _GIVEN:
            value = _GIVEN[p.name]()
        elif p.has_default_value():
            value = _arg(p.default_value, {})
        else:
            return None
        if p.kwarg_only:
            kwargs[p.name] = value
        else:
            args.append(value)
    return tuple(args), pmap(kwargs)


def _by(named: tuple[tuple[Arg, ...], PMap[str, Arg]] | None, given: PMap[str, Arg] | None = None) -> dict[str, Any]:
    """``replace``'s arguments for a call given as the op takes it (``named``), else ``given`` keywords."""
    if named is not None:
        return {"args": named[0], "kwargs": named[1]}
    return {} if given is None else {"kwargs": given}


# a function's argument by the name of the ATen op's
_RENAMED = {"training": "train"}


# the modules a function a symbolic_trace graph calls comes from (``torch.sigmoid``, ``F.silu``, ``F.gelu``)
_TORCH_FUNCTIONS = ("torch._VariableFunctionsClass.", "torch.nn.functional.", "torch._C._nn.")
# of an ATen op's overloads, the one a call by its name stands for (``torch.softmax(x, 1)``: ``softmax.int``)
_OVERLOADS = ("default", "Tensor", "int", "dim", "input")


@functools.cache
def _aten_ops() -> frozenset[str]:
    """The name of every ATen op (not a private one)."""
    names = {s.split("::")[1].split(".")[0] for s in torch._C._dispatch_get_all_op_names() if s.startswith("aten::")}
    return frozenset(n for n in names if not n.startswith("_"))


@functools.cache
def _aten_named(name: str) -> str | None:
    """The canonical target of the ATen op called ``name`` (its overload of ``_OVERLOADS``, else its
    first), or None where ATen has no public op of that name (``sym_float``, ``_assert``)."""
    if name not in _aten_ops() or name.startswith("sym_"):
        return None
    overloads = sorted(getattr(torch.ops.aten, name).overloads())
    chosen = next((o for o in _OVERLOADS if o in overloads), overloads[0] if overloads else None)
    return None if chosen is None else f"aten.{name}.{chosen}"


@functools.cache
def _by_class_name() -> dict[str, str]:
    """ATen's ops (not the in-place ones) by their name without underscores, as a module's class
    is named: ``leakyrelu`` for ``leaky_relu``."""
    return {n.replace("_", ""): n for n in sorted(_aten_ops()) if not n.endswith("_")}


def _module_as_aten(module: object) -> tuple[str, dict[str, Arg]] | None:
    """The ATen op a ``torch.nn`` module computes, by its class name, with the module's settings as
    the op's arguments of their names (``nn.LeakyReLU(0.2)``: ``leaky_relu`` of ``negative_slope``
    0.2; ``nn.Softmax(dim=1)``: ``softmax`` of ``dim`` 1); None where the op needs an argument the
    module has no setting of (``nn.Unfold`` is no ``aten.unfold``)."""
    kind = type(module)
    name = _by_class_name().get(kind.__name__.lower()) if kind.__module__.startswith("torch.nn.") else None
    target = _aten_named(name) if name is not None else None
    if target is None:
        return None
    given: dict[str, Arg] = {}
    for param, value in _held(module, target):
        if value is None or isinstance(value, torch.Tensor):  # (a parameter: no node of the view's)
            if not param.has_default_value():
                return None
            continue
        given[param.name] = _arg(value, {})
    return target, given


def _one_by_one(args: tuple[Arg, ...]) -> bool:
    """A tensor's method given its list one value at a time: several, or one number (``y.view(-1)``;
    one node may be a whole size, ``y.view(x.size())``)."""
    return len(args) > 2 or (len(args) == 2 and type(args[1]) is int)


@functools.cache
def _listed(target: str) -> bool:
    """The ATen op's one positional argument after ``self`` is a list (``permute``'s ``dims``,
    ``view``'s ``size``), which a tensor's method also takes one by one (``w.permute(1, 0)``);
    Python does not where more follow (``x.amax(1, True)``: ``dim`` 1, ``keepdim``)."""
    _, op, overload = target.split(".")
    positional = [a for a in getattr(getattr(torch.ops.aten, op), overload)._schema.arguments[1:] if not a.kwarg_only]
    return len(positional) == 1 and isinstance(positional[0].type, torch.ListType)


def _arithmetic(n: NodeSnapshot) -> str | None:
    """The ATen op a traced graph's arithmetic call exports as, or a call of a torch function or a
    tensor method the ATen op of its name (``torch.sigmoid``, ``x.t()``); None for arithmetic given
    ``out=`` (``aten.mul.out``, a write no rule anchors at)."""
    target = _OPERATORS.get((n.op, n.target))
    if n.target == "builtins.getattr" and len(n.args) == 2 and not n.kwargs and type(n.args[1]) is str:
        return _ATTRIBUTES.get(n.args[1])  # (read as the op of the tensor alone: ``_as_aten``)
    given = set(n.kwargs)
    if target is None:
        function = n.op == "call_function" and n.target.startswith(_TORCH_FUNCTIONS)
        named = n.target if n.op == "call_method" else n.target.rsplit(".", 1)[-1] if function else None
        return _aten_named(named) if named is not None and "out" not in given else None
    if not given <= {"input", "self", "other", "alpha", "rounding_mode"}:
        return None
    if "rounding_mode" in given:
        return "aten.div.Tensor_mode" if target == "aten.div.Tensor" else None
    return target


def _anchors(rule: Any, snap: GraphSnapshot) -> list[NodeSnapshot]:
    try:
        return list(rule.anchors(snap))
    except Exception:  # a hand-written rule that cannot read a probe snapshot has nothing to report there
        return []


@final
class _Traced(NamedTuple):
    """A GraphModule read as the ATen ops it calls (None where it calls none otherwise), the nodes
    that are Python's arithmetic, and how each node read so is spelled (``is Python's mul``, ``is
    torch's sigmoid``, ``calls an nn.Softmax module``)."""

    view: GraphSnapshot | None
    arithmetic: frozenset[str]
    spelled: dict[str, str]


def _traced(cap: Captured) -> _Traced:
    """``cap``'s :class:`_Traced`, found once (an exported program holds ATen ops, and Python's
    arithmetic on sizes only: nothing to read)."""
    if cap.traced is not None:
        return cap.traced
    spelled: dict[str, str] = {}
    arithmetic: set[str] = set()
    settings = _generic_modules(cap) if not isinstance(cap.program, ExportedProgram) else {}
    for n in cap.snap.nodes if not isinstance(cap.program, ExportedProgram) else ():
        if n.name in settings:
            spelled[n.name] = f"calls an nn.{type(_attr(cap.gm, n.target)).__name__} module"
        elif _arithmetic(n) is not None or (n.op, n.target) in _OPERATORS:
            target = str(n.target)
            whose = "Python's" if target.startswith("_operator.") else "torch's" if "." in target else "the method"
            spelled[n.name] = f"is {whose} {target.rsplit('.', 1)[-1]}"
            if target == "builtins.getattr":
                spelled[n.name] = f"is the attribute {n.args[1]}"
            if (n.op, n.target) in _OPERATORS:
                arithmetic.add(n.name)
    view = _as_aten(cap, settings) if cap.module_calls or spelled else None
    cap.traced = _Traced(view, frozenset(arithmetic), spelled)
    return cap.traced


def unreachable(cap: Captured, rule: Any, within: str = "") -> list[tuple[str, Reason]]:
    """The candidates of ``rule`` that fxpure does not rewrite, each with a typed reason: a module
    call in a ``symbolic_trace`` GraphModule (its parameters live in the module), or a node the rule
    would take for one through such a call or through Python's arithmetic (``self.conv(x) * 2.0``,
    declined at the ``mul``; the input two linear modules read), and the nodes of
    control-flow branches (``torch.cond``: only the top-level graph is rewritten), named by the
    branches they are in (``within``: the outer ones', as ``true_graph_0.``)."""
    out: list[tuple[str, Reason]] = []
    traced = _traced(cap)
    if traced.view is not None:
        calls = {name: what for name, _, what in cap.module_calls}
        real = {a.name for a in _anchors(rule, cap.snap)}
        for a in _anchors(rule, traced.view):
            if a.name in real or a.name not in cap.snap.index:  # (not a weight the ATen view gave a module)
                continue
            via = next((n for n in (a.name, *ref_list(a)) if n in calls), None)
            if via is None and a.name not in traced.arithmetic:  # the input two linear modules read
                via = next((u for u in cap.snap.users.get(a.name, ()) if u in calls), None)
            # else the op itself, or what it reads, is spelled otherwise than in ATen
            spelled = next((n for n in (a.name, *ref_list(a)) if n in traced.spelled), None)
            if via is not None:
                what = f"{'' if via == a.name else f'{a.name}: '}{via} calls {calls[via]}"
            elif spelled is not None:
                what = f"{'' if spelled == a.name else f'{a.name}: '}{spelled} {traced.spelled[spelled]}"
            else:
                continue
            detail = (
                f"{what} (a symbolic_trace GraphModule); fxpure rewrites ATen ops:"
                " capture the model with torch.export and apply the rule to that"
            )
            out.append((f"{within}{a.name}", Declined(code="module-call", node=f"{within}{a.name}", detail=detail)))
    for attr, branch in cap.branches:
        inner, path = capture_program(branch), f"{within}{attr}"
        for a in _anchors(rule, inner.snap):
            where = f"{path}.{a.name}"
            detail = f"{a.name} is in {path}, a control-flow branch: fxpure rewrites the top-level graph only"
            out.append((where, Declined(code="in-subgraph", node=where, detail=detail)))
        out.extend(unreachable(inner, rule, f"{path}."))
    return out


def capture(program: Program) -> GraphSnapshot:
    """The immutable snapshot of a GraphModule or ExportedProgram; O(nodes)."""
    return capture_program(program).snap


def _same_node(a: NodeSnapshot, b: NodeSnapshot) -> bool:
    """One node in two captures of a program: a spec only one of them knows is no difference (a
    program saved and loaded again, or run through FakeTensorProp, knows more of its output)."""
    return a is b or (
        (a.name, a.op, a.target, a.args, a.kwargs) == (b.name, b.op, b.target, b.args, b.kwargs)
        and (a.spec == b.spec or a.spec is None or b.spec is None)
    )


def changed_since(before: GraphSnapshot, now: GraphSnapshot) -> str | None:
    """How ``now`` differs from ``before`` (nodes, and constants but for their storage: a copy of
    the program is the same program), or None."""
    if len(now.nodes) != len(before.nodes) or not all(map(_same_node, before.nodes, now.nodes)):
        pairs = zip(before.nodes, now.nodes, strict=False)
        old, new = next(((a, b) for a, b in pairs if not _same_node(a, b)), (None, None))
        if old is None or new is None:
            return f"it has {len(now.nodes)} nodes, the report's program {len(before.nodes)}"
        if old.name != new.name:
            return f"it has node {new.name} where the report's program has {old.name}"
        return f"its node {new.name} is not the report's (another target, other arguments or another spec)"
    unstored = {k: replace(v, storage=None) for k, v in before.constants.items()}
    if {k: replace(v, storage=None) for k, v in now.constants.items()} != unstored:
        return "its constants are not the report's"
    return None
