"""Schemas and op families built while a test runs (mutmut swaps a function's body in at call
time, so the schemas and families built at import are always the original ones): what
``parse_schema`` reads from torch's notation, ``bind``/``respell``/``arguments`` on the parsed
schema, ``family`` and the union of two families (``A | B``), and the conv family's normal form."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from pyrsistent import pmap
from returns.result import Failure, Result, Success

from fxpure.families import CONV, family
from fxpure.reasons import Malformed
from fxpure.schema import Param, arguments, bind, parse_schema, respell
from fxpure.snapshot import Arg, DTypeArg, GraphSnapshot, NodeRef, NodeSnapshot, Opaque, snapshot
from fxpure.testing import spec

X, Y, Z = NodeRef("x"), NodeRef("y"), NodeRef("z")


def call(target: str, *args: Arg, name: str = "n", **kwargs: Arg) -> NodeSnapshot:
    return NodeSnapshot(name=name, op="call_function", target=target, args=args, kwargs=pmap(kwargs))


def ok(result: Result[Mapping[str, Arg], Malformed]) -> dict[str, Arg]:
    assert isinstance(result, Success), result
    return dict(result.unwrap())


def failed(result: Result[Mapping[str, Arg], Malformed]) -> str:
    assert isinstance(result, Failure), result
    reason: Malformed = result.failure()
    return reason.message


def one(param: str) -> Param:
    """The one parameter of a schema declaring just ``param``."""
    (p,) = parse_schema(f"aten.f.default({param}) -> Tensor").params
    return p


# --- parse_schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Tensor self", Param("self", "tensor", False, False, False, None)),
        ("Tensor(a!) self", Param("self", "tensor", False, False, False, None)),
        ("Tensor? bias=None", Param("bias", "tensor", True, False, True, None)),
        ("Tensor(a)? out=None", Param("out", "tensor", True, False, True, None)),
        ("Tensor?[] indices", Param("indices", "tensors", False, False, False, None)),
        ("Tensor[] tensors", Param("tensors", "tensors", False, False, False, None)),
        ("SymInt[2] padding=[0, 0]", Param("padding", "ints", False, False, True, (0, 0))),
        ("int[1] dims=[-1]", Param("dims", "ints", False, False, True, (-1,))),
        # torch's notation for a list of one repeated value: the list is what torch takes
        ("SymInt[2] stride=1", Param("stride", "ints", False, False, True, (1, 1))),
        ("int[3] dilation=1", Param("dilation", "ints", False, False, True, (1, 1, 1))),
        ("SymInt[] size=1", Param("size", "ints", False, False, True, 1)),
        ("int[] size=[]", Param("size", "ints", False, False, True, ())),
        ("SymInt? start=None", Param("start", "int", True, False, True, None)),
        ("int dim=-1", Param("dim", "int", False, False, True, -1)),
        ("bool training=True", Param("training", "bool", False, False, True, True)),
        ("bool keepdim=False", Param("keepdim", "bool", False, False, True, False)),
        ("float eps=1e-05", Param("eps", "float", False, False, True, 1e-05)),
        ("float? momentum=0.1", Param("momentum", "float", True, False, True, 0.1)),
        ("Scalar alpha=1", Param("alpha", "scalar", False, False, True, 1)),
        ("ScalarType? dtype=None", Param("dtype", "dtype", True, False, True, None)),
        # torch prints a ScalarType default as its number in c10's enum (torchao's dequantize_affine)
        ("ScalarType output_dtype=6", Param("output_dtype", "dtype", False, False, True, DTypeArg("float32"))),
        ("ScalarType dtype=15", Param("dtype", "dtype", False, False, True, DTypeArg("bfloat16"))),
        ("ScalarType dtype=0", Param("dtype", "dtype", False, False, True, DTypeArg("uint8"))),
        ("ScalarType dtype=1000", Param("dtype", "dtype", False, False, True, 1000)),  # (refused when bound)
        ('str padding="valid"', Param("padding", "str", False, False, True, "valid")),
        (
            "MemoryFormat memory_format=contiguous_format",
            Param("memory_format", "any", False, False, True, Opaque("contiguous_format")),
        ),
        ("MemoryFormat? memory_format=None", Param("memory_format", "any", True, False, True, None)),
        ("Any self", Param("self", "any", False, False, False, None)),
        # a default that only looks like a list or a string at one end is not one
        ("int size=sizes[0]", Param("size", "int", False, False, True, Opaque("sizes[0]"))),
        ('str mode="open', Param("mode", "str", False, False, True, Opaque('"open'))),
    ],
)
def test_parse_reads_kind_optional_and_default(text: str, expected: Param) -> None:
    assert one(text) == expected


def test_parse_splits_at_top_level_commas_only() -> None:
    s = parse_schema("aten.f.default(int[][] x=[[1, 2], [3]], Tensor X, Tensor Y) -> Tensor")
    assert [p.name for p in s.params] == ["x", "X", "Y"]
    assert s.params[0].default == ((1, 2), (3,))


def test_parse_marks_keyword_only_after_star() -> None:
    s = parse_schema(
        "aten.addmm.default(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor"
    )
    assert s.target == "aten.addmm.default"
    assert [p.keyword_only for p in s.params] == [False, False, False, True, True]
    assert s.positional == ("self", "mat1", "mat2")
    assert s.params[0] == Param("self", "tensor", False, False, False, None)
    assert s.params[4] == Param("alpha", "scalar", False, True, True, 1)


@pytest.mark.parametrize(
    ("ret", "outputs"),
    [
        ("Tensor", 1),
        ("Tensor(a!)", 1),
        ("Tensor[]", 1),
        ("(Tensor, Tensor, Tensor)", 3),
        ("(Tensor(a!) values, Tensor(b!) indices)", 2),
    ],
)
def test_parse_counts_outputs(ret: str, outputs: int) -> None:
    s = parse_schema(f"aten.f.default(Tensor self) -> {ret}")
    assert (s.outputs, s.tuple_output) == (outputs, outputs > 1)


def test_parse_rejects_text_that_is_not_a_schema() -> None:
    with pytest.raises(ValueError, match=r"^not a schema: 'aten\.mm\.default\(Tensor self\)'$"):
        parse_schema("aten.mm.default(Tensor self)")


def test_rename_and_fixed_give_the_family_names() -> None:
    s = parse_schema(
        "aten.reshape.default(Tensor self, SymInt[] shape) -> Tensor", rename={"shape": "size"}, fixed={"copy": False}
    )
    assert s.names == frozenset({"self", "size", "copy"})
    assert s.param("size") == Param("shape", "ints", False, False, False, None)
    assert s.param("copy") is None
    assert ok(bind(call("aten.reshape.default", X, (2, -1)), s)) == {"self": X, "size": (2, -1), "copy": False}


# --- bind --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "node", "expected"),
    [
        ("Tensor input, Tensor? bias=None", call("t", X), {"input": X, "bias": None}),
        ("Tensor input, Tensor? bias=None", call("t", X, Y), {"input": X, "bias": Y}),
        ("Any self, int index", call("t", None, 0), {"self": None, "index": 0}),
        ("Tensor[] tensors, int dim=0", call("t", (X, Y)), {"tensors": (X, Y), "dim": 0}),
        ("Tensor?[] indices", call("t", (None, X)), {"indices": (None, X)}),
        ("Tensor self, SymInt?[] sizes", call("t", X, (1, None)), {"self": X, "sizes": (1, None)}),
        ("Tensor self, Tensor other", call("t", X, 2.5), {"self": X, "other": 2.5}),
        ("Tensor self, Scalar other", call("t", X, True), {"self": X, "other": True}),
        ("Tensor self, *, Scalar beta=1, Scalar alpha=1", call("t", X, alpha=2), {"self": X, "beta": 1, "alpha": 2}),
    ],
)
def test_bind_fills_defaults_and_accepts_what_fits(params: str, node: NodeSnapshot, expected: dict[str, Arg]) -> None:
    assert ok(bind(node, parse_schema(f"t({params}) -> Tensor"))) == expected


@pytest.mark.parametrize(
    ("params", "node", "message"),
    [
        ("Tensor self, Tensor mat2", call("t", None, X), "n: self=None is not a tensor"),
        ("Tensor self, Tensor other", call("t", X, "x"), "n: other='x' is not a tensor"),
        ("Tensor self, float eps", call("t", X, True), "n: eps=True is not a float"),
        ("Tensor[] tensors", call("t", X), "n: tensors=NodeRef(name='x') is not a tensors"),
        ("Tensor self, int dim", call("t", X, 1.5), "n: dim=1.5 is not a int"),
        ("Tensor self, Tensor mat2", call("t", X, Y, Z), "n: 3 positional arguments"),
        ("Tensor self, Tensor mat2", call("t", X, self=Y), "n: unexpected keyword 'self'"),
        ("Tensor self, Tensor mat2", call("t", X, other=Y), "n: unexpected keyword 'other'"),
        ("Tensor self, Tensor mat2", call("t", X), "n: missing argument 'mat2'"),
    ],
)
def test_bind_rejects_what_does_not_fit(params: str, node: NodeSnapshot, message: str) -> None:
    assert failed(bind(node, parse_schema(f"t({params}) -> Tensor"))) == message


# --- respell and arguments -------------------------------------------------------------------------

SLICE = "t(Tensor self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1) -> Tensor"
ADDMM = "t(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor"
RESHAPE = "t(Tensor self, SymInt[] shape) -> Tensor"


def test_respell_keeps_the_node_spelling() -> None:
    slice_, addmm = parse_schema(SLICE), parse_schema(ADDMM)
    n = call("t", X, 1, 0, end=4)
    assert respell(n, slice_, {"self": Y, "end": 8}) == ((Y, 1, 0), pmap({"end": 8}))
    assert respell(n, slice_, {"step": 2, "start": 3}) == ((X, 1, 3), pmap({"end": 4, "step": 2}))
    assert respell(call("t", X, 1), slice_, {"end": 5, "start": 2}) == ((X, 1, 2, 5), pmap())
    assert respell(call("t", X, 1), slice_, {"extra": 7, "start": 2}) == ((X, 1, 2), pmap({"extra": 7}))
    # a None the argument takes when left out is left out, and what comes after it is still given
    assert respell(call("t", X, 1), slice_, {"start": None, "end": 5}) == ((X, 1), pmap({"end": 5}))
    assert respell(call("t", X, Y, Z), addmm, {"alpha": 3}) == ((X, Y, Z), pmap({"alpha": 3}))
    s = parse_schema(RESHAPE, rename={"shape": "size"})
    assert respell(call("t", X), s, {"size": (4,)}) == ((X, (4,)), pmap())


def test_arguments_fill_gaps_with_defaults() -> None:
    slice_, addmm = parse_schema(SLICE), parse_schema(ADDMM)
    assert arguments(slice_, {"self": X, "end": 5}) == ((X, 0, None, 5), pmap())
    assert arguments(slice_, {"end": 5, "self": X, "step": 2}) == ((X, 0, None, 5, 2), pmap())
    assert arguments(addmm, {"self": X, "mat1": Y, "mat2": Z, "alpha": 2}) == ((X, Y, Z), pmap({"alpha": 2}))
    s = parse_schema(RESHAPE, rename={"shape": "size"})
    assert arguments(s, {"size": (1, -1), "self": X}) == ((X, (1, -1)), pmap())
    assert arguments(s, {}) == ((), pmap())
    # a gap before a later argument holds what torch takes there: conv2d's stride as a list
    conv2d = CONV.schemas["aten.conv2d.default"]
    assert arguments(conv2d, {"input": X, "weight": Y, "groups": 3}) == (
        (X, Y, None, (1, 1), (0, 0), (1, 1), 3),
        pmap(),
    )


def test_a_schemas_arguments_go_by_the_familys_names_and_the_required_ones_are_listed() -> None:
    s, slice_ = parse_schema(RESHAPE, rename={"shape": "size"}), parse_schema(SLICE)
    assert list(s.family_params) == ["self", "size"] and s.required == ("self", "size")
    assert s.family_params["size"].name == "shape"  # the schema's own name, under the family's
    assert slice_.required == ("self",)  # dim, start, end and step have defaults


# --- families ----------------------------------------------------------------------------------------


def tag(snap: GraphSnapshot, node: NodeSnapshot, args: Mapping[str, Arg]) -> Result[Mapping[str, Arg], Malformed]:
    """A normaliser that records which node of which graph it saw."""
    return Success({**args, "seen": (node.name, len(snap.nodes))})


def unary(op: str) -> str:
    return f"aten.{op}.default(Tensor self) -> Tensor"


GRAPH = snapshot(
    [
        NodeSnapshot(name="x", op="placeholder", target="x"),
        call("aten.p.default", X, name="p"),
        call("aten.q.default", X, name="q"),
    ],
    {},
)
P, Q = GRAPH.node("p"), GRAPH.node("q")


def test_family_from_text_and_parsed_schemas() -> None:
    parsed = parse_schema("aten.q.default(Tensor input) -> Tensor", rename={"input": "self"}, fixed={"k": 1})
    f = family("pq", "a p or q", [unary("p"), parsed], normalize=tag, commutes=("self", "other"))
    assert (f.name, f.noun, f.normalize, f.commutes) == ("pq", "a p or q", tag, ("self", "other"))
    assert f.schemas["aten.q.default"] is parsed
    assert f.targets == frozenset({"aten.p.default", "aten.q.default"})
    assert f.params == frozenset({"self", "k"})
    assert f.kinds("self") == frozenset({"tensor"})
    assert f.kinds("k") == frozenset()
    assert ok(f.bind(GRAPH, Q)) == {"self": X, "k": 1, "seen": ("q", 3)}
    assert failed(f.bind(GRAPH, GRAPH.node("x"))) == "x: x is not a p or q"
    assert failed(family("m", "a matrix product", []).bind(GRAPH, P)) == "p: aten.p.default is not a matrix product"


def test_union_keeps_what_both_share() -> None:
    a = family("a", "an op", [unary("p")], normalize=tag, commutes=("self", "other"))
    b = family("b", "an op", [unary("q")], normalize=tag, commutes=("self", "other"))
    u = a | b
    assert (u.name, u.noun, u.normalize, u.commutes) == ("a|b", "an op", tag, ("self", "other"))
    assert u.schemas == {**a.schemas, **b.schemas}
    assert ok(u.bind(GRAPH, P)) == {"self": X, "seen": ("p", 3)}


def test_union_of_different_families() -> None:
    a = family("a", "a p", [unary("p")], commutes=("self", "other"))
    b = family("b", "a q", [unary("q")])
    for u, name, noun in ((a | b, "a|b", "a p or a q"), (b | a, "b|a", "a q or a p")):
        assert (u.name, u.noun, u.normalize, u.commutes) == (name, noun, None, None)
        assert u.targets == frozenset({"aten.p.default", "aten.q.default"})
        assert ok(u.bind(GRAPH, P)) == {"self": X}


def test_union_normalises_each_spelling_as_its_own_family_does() -> None:
    tagged = family("t", "an op", [unary("p")], normalize=tag)
    plain = family("u", "an op", [unary("q")])
    for u in (tagged | plain, plain | tagged):
        assert u.normalize is not None
        assert ok(u.bind(GRAPH, P)) == {"self": X, "seen": ("p", 3)}
        assert ok(u.bind(GRAPH, Q)) == {"self": X}


def test_union_schemas_of_the_right_family_win() -> None:
    a = family("a", "an op", [unary("p")])
    b = family("b", "an op", [parse_schema("aten.p.default(Tensor input) -> Tensor")])
    assert (a | b).params == frozenset({"input"})
    assert (b | a).params == frozenset({"self"})


# --- the conv family's normal form ----------------------------------------------------------------

W, BARE, FLAT = NodeRef("w"), NodeRef("bare"), NodeRef("flat")
CONVS = snapshot(
    [
        NodeSnapshot(name="x", op="placeholder", target="x", spec=spec(1, 3, 8, 8)),
        NodeSnapshot(name="w", op="placeholder", target="w", spec=spec(4, 3, 3, 3)),
        NodeSnapshot(name="bare", op="placeholder", target="bare"),
        NodeSnapshot(name="flat", op="placeholder", target="flat", spec=spec(4, 3)),
        NodeSnapshot(name="x1", op="placeholder", target="x1", spec=spec(1, 3, 8)),
        NodeSnapshot(name="x3", op="placeholder", target="x3", spec=spec(1, 3, 8, 8, 8)),
    ],
    {},
)
CONVOLUTION = "aten.convolution.default"


def conv(target: str, *args: Arg, **kwargs: Arg) -> Result[Mapping[str, Arg], Malformed]:
    return CONV.bind(CONVS, call(target, *args, name="conv", **kwargs))


def test_conv_normal_form() -> None:
    assert ok(conv("aten.conv2d.default", X, W)) == {
        "input": X,
        "weight": W,
        "bias": None,
        "stride": (1, 1),
        "padding": (0, 0),
        "dilation": (1, 1),
        "groups": 1,
        "transposed": False,
        "output_padding": (0, 0),
        "rank": 2,
    }
    assert ok(conv("aten.conv2d.padding", X, W, padding="same"))["padding"] == "same"
    assert ok(conv(CONVOLUTION, X, W, None, 2, 0, 1, False, 0, 1))["stride"] == (2, 2)


@pytest.mark.parametrize(
    ("target", "rank"),
    [
        ("aten.conv1d.default", 1),
        ("aten.conv2d.default", 2),
        ("aten.conv3d.padding", 3),
        ("aten.conv_transpose1d.default", 1),
        ("aten.conv_transpose2d.input", 2),
        ("aten.conv_transpose3d.input", 3),
    ],
)
def test_conv_rank_comes_from_the_spelling(target: str, rank: int) -> None:
    bound = ok(conv(target, NodeRef({1: "x1", 2: "x", 3: "x3"}[rank]), BARE))
    assert (bound["rank"], bound["stride"]) == (rank, (1,) * rank)


def _conv_node(target: str, x: NodeRef, out: tuple[int, ...] | None) -> NodeSnapshot:
    args: tuple[Arg, ...] = (x, W) if target != CONVOLUTION else (x, W, None, 1, 0, 1, False, 0, 1)
    return NodeSnapshot(
        name="conv", op="call_function", target=target, args=args, spec=None if out is None else spec(*out)
    )


@pytest.mark.parametrize(
    ("target", "x", "out", "message"),
    [
        # an unbatched input: its channels are dim 0, not the 1 a rule reads them from
        ("aten.conv2d.default", "flat", None, "input has shape (4, 3), not (N, C) and 2 spatial dims"),
        ("aten.conv2d.default", "bare", (4, 6, 6), "output has shape (4, 6, 6), not (N, C) and 2 spatial dims"),
        ("aten.conv2d.default", "bare", None, "no shape tells whether the input is a batch"),
        ("aten.conv2d.default", "gone", None, "no shape tells whether the input is a batch"),  # not in the graph
        ("aten.conv2d.default", "x", None, None),
        ("aten.conv2d.default", "bare", (1, 4, 6, 6), None),
        (CONVOLUTION, "bare", None, None),  # aten.convolution has no unbatched form
    ],
)
def test_a_conv_must_run_on_a_batch(target: str, x: str, out: tuple[int, ...] | None, message: str | None) -> None:
    result = CONV.bind(CONVS, _conv_node(target, NodeRef(x), out))
    if message is None:
        assert ok(result)["rank"] == 2
    else:
        assert failed(result) == f"conv: {message}: an unbatched conv is not rewritten"


@pytest.mark.parametrize(
    ("target", "args", "kwargs", "message"),
    [
        (CONVOLUTION, (X, BARE, None, 1, 0, 1, False, 0, 1), {}, "conv: cannot tell rank, transposed or groups"),
        (CONVOLUTION, (X, FLAT, None, 1, 0, 1, False, 0, 1), {}, "conv: cannot tell rank, transposed or groups"),
        (
            CONVOLUTION,
            (X, NodeRef("gone"), None, 1, 0, 1, False, 0, 1),
            {},
            "conv: cannot tell rank, transposed or groups",
        ),
        (CONVOLUTION, (X, 2.0, None, 1, 0, 1, False, 0, 1), {}, "conv: cannot tell rank, transposed or groups"),
        ("aten.conv2d.default", (X, W), {"groups": 0}, "conv: cannot tell rank, transposed or groups"),
        ("aten.conv2d.default", (X, W), {"groups": NodeRef("g")}, "conv: cannot tell rank, transposed or groups"),
        ("aten.conv2d.default", (2.0, W), {}, "conv: input is 2.0, expected a tensor"),
        ("aten.conv2d.default", (X, 2.0), {}, "conv: weight is 2.0, expected a tensor"),
        ("aten.conv3d.default", (X, W), {}, "conv: weight of shape (4, 3, 3, 3) does not fit a 3-d convolution"),
        (
            "aten.conv2d.default",
            (X, W, None, (1, NodeRef("s"))),
            {},
            "conv: stride=(1, NodeRef(name='s')) is not a list of ints",
        ),
        ("aten.conv2d.default", (X, W, None, 1, (1, 1, 1)), {}, "conv: padding=(1, 1, 1) does not fit 2 spatial dims"),
    ],
)
def test_conv_rejects_what_it_cannot_normalise(
    target: str, args: tuple[Arg, ...], kwargs: dict[str, Arg], message: str
) -> None:
    assert failed(conv(target, *args, **kwargs)) == message


def test_a_bound_node_is_bound_again_under_another_schema_and_copies_as_it_was() -> None:
    # bind keeps a node's arguments for the schema last asked (a node is bound many times); another
    # schema of the same target binds anew, and a copy or a pickle of the node drops what was kept
    import copy
    import pickle

    mm = parse_schema("aten.mm.default(Tensor self, Tensor mat2) -> Tensor")
    other = parse_schema("aten.mm.default(Tensor input, Tensor other) -> Tensor")
    n = NodeSnapshot(name="mm", op="call_function", target="aten.mm.default", args=(NodeRef("a"), NodeRef("b")))
    first = bind(n, mm)
    assert bind(n, mm) is first and dict(first.unwrap()) == {"self": NodeRef("a"), "mat2": NodeRef("b")}
    assert dict(bind(n, other).unwrap()) == {"input": NodeRef("a"), "other": NodeRef("b")}
    assert dict(bind(n, mm).unwrap()) == {"self": NodeRef("a"), "mat2": NodeRef("b")}
    for made in (copy.copy(n), copy.deepcopy(n), pickle.loads(pickle.dumps(n))):
        assert made == n and made.args == n.args and dict(bind(made, mm).unwrap()) == dict(first.unwrap())


def test_a_node_leaving_out_a_scalar_type_torch_defaults_by_number_binds_that_dtype() -> None:
    # found by an outside author (torchao's dequantize_affine, ``ScalarType output_dtype=6``): the
    # default was read as the int 6, and every such node was malformed ("6 is not a dtype")
    schema = parse_schema("my.dq.default(Tensor input, ScalarType input_dtype, ScalarType output_dtype=6) -> Tensor")
    node = call("my.dq.default", X, DTypeArg("int8"))
    assert ok(bind(node, schema)) == {"input": X, "input_dtype": DTypeArg("int8"), "output_dtype": DTypeArg("float32")}
