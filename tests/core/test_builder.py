"""``fxpure.testing.GraphBuilder`` and the snapshot it builds: defaults a test relies on without
writing them (dtype, kind, lifting), per-constant overrides, tuple outputs, calls found by target in
graph order, and the reason a malformed snapshot gives. Torch-free."""

from __future__ import annotations

from dataclasses import replace

import pytest
from returns.result import Failure, Success

from fxpure.families import MUL, PERMUTE
from fxpure.pattern import Const, Lit, Op, Var, match
from fxpure.reasons import InvalidSnapshot
from fxpure.schema import parse_schema
from fxpure.snapshot import DTypeArg, GraphSnapshot, KnownConstants, NodeRef, NodeSnapshot, snapshot, verify
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Reshape, Source


def test_defaults_a_test_does_not_write() -> None:
    g = GraphBuilder()
    g.input("x", (2, "n"))
    g.input("i", (3,), dtype="int8")
    g.constant("c", (4,))
    snap = g.build()
    assert snap.node("x").spec == spec(2, "n")
    assert snap.node("i").spec == spec(3, dtype="int8")
    c = snap.constants["c"]
    assert (c.kind, c.key, c.spec, c.storage, c.values) == ("constant", "c", spec(4), None, None)
    assert (snap.node("c").op, snap.lifted, snap.dialect) == ("placeholder", True, "aten")
    assert snapshot([], {}).lifted is True


def test_a_constant_can_be_lifted_or_an_attribute_whatever_the_graph() -> None:
    g = GraphBuilder()
    g.constant("attr", (2,), lifted=False)
    g.constant("lifted", (2,))
    h = GraphBuilder(lifted=False)
    h.constant("lifted", (2,), lifted=True)
    h.constant("attr", (2,))
    for snap in (g.build(), h.build()):
        assert (snap.node("lifted").op, snap.node("attr").op) == ("placeholder", "get_attr")


def test_parameters_and_buffers_keep_their_storage_key_and_values() -> None:
    g = GraphBuilder()
    g.parameter("w", (2,), key="layer.w", storage="s0")
    g.buffer("z", (2,), dtype="int32", key="layer.z", values=[0, 1], storage="s1")
    infos = g.build().constants
    assert (infos["w"].kind, infos["w"].key, infos["w"].storage) == ("parameter", "layer.w", "s0")
    z = infos["z"]
    assert (z.kind, z.key, z.storage, z.values, z.spec) == ("buffer", "layer.z", "s1", (0, 1), spec(2, dtype="int32"))


def test_a_tuple_output_keeps_a_spec_per_element() -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    two = g.node("t", (x,), name="two", out=(spec(2), spec(3, dtype="int8")))
    half = g.node("t", (x,), name="half", out=(spec(2), None))
    shaped = g.node("t", (x,), name="shaped", out=(4, "n"))
    g.output(two, half, shaped)
    snap = g.build()
    assert snap.node("two").spec == (spec(2), spec(3, dtype="int8"))
    assert snap.node("half").spec == (spec(2), None)
    assert snap.node("shaped").spec == spec(4, "n")


def test_calls_are_named_after_their_target_and_an_unknown_one_is_refused() -> None:
    g = GraphBuilder(schemas=[parse_schema("myop(Tensor self) -> Tensor")])
    x = g.input("x", (2,))
    assert g.call("myop", self=x) == NodeRef("myop")
    assert g.call("aten.relu.default", self=x) == NodeRef("relu")
    assert g.call("aten.relu.default", self=x) == NodeRef("relu_1")
    with pytest.raises(KeyError, match=r"no schema for aten.nope.default: give GraphBuilder\(schemas="):
        g.call("aten.nope.default", self=x)


def test_calls_by_target_come_in_graph_order() -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    g.node("t2", (x,), name="b_first")
    g.node("t1", (x,), name="a_second")
    g.node("t2", (x,), name="c_third")
    snap = g.build()
    assert [n.name for n in snap.calls(["t1", "t2"])] == ["b_first", "a_second", "c_third"]
    assert [n.name for n in snap.calls(["t1", "t2"][::-1])] == ["b_first", "a_second", "c_third"]
    h = GraphBuilder()
    y = h.input("y", (2,))
    h.node("t2", (y,), name="b_first")
    h.node("t1", (y,), name="a_second")
    assert [n.name for n in h.build().calls(["t1", "t2"])] == ["b_first", "a_second"]  # exactly two


def test_a_duplicate_node_name_is_reported_at_the_node() -> None:
    node = NodeSnapshot(name="a", op="placeholder", target="a")
    assert verify(snapshot([node, node], {})) == Failure(InvalidSnapshot(node="a", detail="duplicate node name"))


def test_a_snapshot_knows_its_constants_names_keys_and_derived_ones_and_verify_checks_them() -> None:
    g = GraphBuilder()
    g.parameter("w", (2,), key="m.weight")
    snap = g.build()
    assert snap.constant_names == {"w"} and snap.constant_keys == {"m.weight"} and not snap.derived
    made = Reshape(x=Source(key="w", spec=spec(2)), shape=(2, 1))
    derived = replace(snap.constants["w"], key="w2", spec=spec(2, 1), source=made)
    both = replace(snap, constants=snap.constants.set("w2", derived))  # (a replaced snapshot finds them anew)
    assert both.constant_names == {"w", "w2"} and both.constant_keys == {"m.weight", "w2"}
    assert dict(both.derived) == {made: "w2"}
    fields = {f: getattr(snap, f) for f in ("nodes", "constants", "dialect", "lifted", "users", "index", "targets")}
    wrong = "constant names or keys disagree with the constants"
    for known in (
        KnownConstants(frozenset(), frozenset({"m.weight"}), {}),
        KnownConstants(frozenset({"w"}), frozenset(), {}),
    ):
        assert verify(GraphSnapshot(**fields, known=known)) == Failure(InvalidSnapshot(node="<graph>", detail=wrong))
    stale = KnownConstants(frozenset({"w"}), frozenset({"m.weight"}), {made: "w"})
    wrong = "derived constants disagree with the constants"
    assert verify(GraphSnapshot(**fields, known=stale)) == Failure(InvalidSnapshot(node="<graph>", detail=wrong))
    h = GraphBuilder()
    h.parameter("w", (2,), key="m.weight")
    h.parameter("w2", (2, 1))
    two = h.build()
    held = snapshot(list(two.nodes), {**two.constants, "w2": replace(two.constants["w2"], source=made)})
    assert dict(held.derived) == {made: "w2"} and verify(held) == Success(held)
    fields = {f: getattr(held, f) for f in fields}
    unknown = KnownConstants(held.constant_names, held.constant_keys, {})  # w2 derived, not known as such
    assert verify(GraphSnapshot(**fields, known=unknown)) == Failure(InvalidSnapshot(node="<graph>", detail=wrong))


def test_a_call_names_the_arguments_its_schema_has_and_needs() -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    with pytest.raises(ValueError, match=r"^aten.relu.default: no argument 'slef', missing 'self' \(it has: self\)"):
        g.call("aten.relu.default", slef=x, out=(2,))
    conv = r"^aten.conv2d.default: missing 'weight' \(it has: bias, dilation, groups, input, padding, stride, weight\)"
    with pytest.raises(ValueError, match=conv):
        g.call("aten.conv2d.default", input=x)
    # a schema's own name its family renames says what the family calls it (an outside author
    # gave dequantize_per_channel ``scales=`` as the docstring said, and was told only "no argument")
    dq = "quantized_decomposed.dequantize_per_channel.default"
    with pytest.raises(ValueError, match=r"no argument 'scales' \(its family calls it 'scale'\)"):
        g.call(dq, input=x, scales=x, zero_point=None, axis=0, quant_min=-127, quant_max=127, dtype="int8")
    # a node of any arguments (a malformed one, on purpose) is still one call away
    assert g.node("aten.relu.default", (), {"slef": x}, name="odd") == NodeRef("odd")


def test_a_dtype_given_by_name_is_held_as_a_captured_program_holds_it() -> None:
    # a str where torch takes a ScalarType would make a node no rule's schema binds (malformed-node)
    g = GraphBuilder()
    x = g.input("x", (2,))
    g.output(g.call("aten._to_copy.default", name="c", self=x, dtype="int8", out=spec(2, dtype="int8")))
    assert g.build().node("c").kwargs["dtype"] == DTypeArg(name="int8")


def test_build_refuses_what_is_no_graph() -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    g.call("aten.relu.default", name="relu_1", self=x)
    g.call("aten.relu.default", self=x)
    g.call("aten.relu.default", self=x)  # named relu_1 too
    with pytest.raises(ValueError, match=r"^not a graph: relu_1: duplicate node name$"):
        g.build()
    h = GraphBuilder()
    h.output(h.call("aten.relu.default", self=NodeRef("nowhere")))
    with pytest.raises(ValueError, match=r"^not a graph: relu: reads 'nowhere' before it is defined$"):
        h.build()


@pytest.mark.parametrize("out", [(spec(2), 3), (None, None), (2, None), ("a", True)])
def test_an_out_the_builder_cannot_read_is_refused(out: object) -> None:
    g = GraphBuilder()
    x = g.input("x", (2,))
    with pytest.raises(ValueError, match=r"give a shape, a spec, or a spec \(or None\) per element"):
        g.call("aten.relu.default", self=x, out=out)  # type: ignore[arg-type]


def test_a_list_argument_is_held_as_a_tuple_as_capture_holds_it() -> None:
    # an outside author's dims=[1, 0] built a node no program has, which the matcher then declined
    g = GraphBuilder()
    w = g.parameter("w", (3, 2))
    t = g.call("aten.permute.default", self=w, dims=[1, 0], out=(2, 3))
    n = g.node("f", ([t, [w]],), {"k": [1, [2]]}, name="n", out=(2,))
    g.output(n)
    snap = g.build()
    assert snap.node("permute").args == (w, (1, 0))
    assert snap.node("n").args == ((t, (w,)),) and snap.node("n").kwargs["k"] == (1, (2,))
    found = match(Op(PERMUTE, name="t", self=Const("w"), dims=Lit((1, 0))), snap, snap.node("permute"))
    assert isinstance(found, Success)


@pytest.mark.parametrize("lifted", [True, False])
def test_a_written_constant_and_its_aliases_are_no_constants_as_capture_makes_them(lifted: bool) -> None:
    # found by a hunt: build(written=[...]) kept a buffer the program scales in place (s.mul_(2)
    # after y = conv(x) * s) among the constants, and fold-binary planned where the captured
    # program declines not-constant (a placeholder, or a get_attr node of a GraphModule)
    g = GraphBuilder(lifted=lifted)
    x = g.input("x", (1, 2, 4, 4))
    w, s = g.parameter("w", (2, 2, 1, 1)), g.buffer("s", (1, 2, 1, 1), storage="S")
    alias = g.buffer("s_view", (2,), storage="S")
    y = g.call("aten.conv2d.default", name="conv", input=x, weight=w, out=(1, 2, 4, 4))
    m = g.call("aten.mul.Tensor", name="m", self=y, other=s, out=(1, 2, 4, 4))
    g.output(m, g.call("aten.mul_.Tensor", name="double", self=s, other=2.0, out=(1, 2, 1, 1)), alias)
    snap = g.build(written=[s])
    assert "s" not in snap.constants and "s_view" not in snap.constants and "w" in snap.constants
    pattern = Op(MUL, name="m", self=Var("y"), other=Const("c"))
    reason = match(pattern, snap, snap.node("m")).failure()
    assert (reason.code, reason.node) == ("not-constant", "m")
    assert reason.message == "other of m is not a constant tensor (it is s, which the program writes)"
    # a computed tensor written in place is computed: so it says
    computed = replace(snap, written=frozenset({"s", "conv"}))
    reason = match(Op(MUL, name="m", self=Const("c"), other=Var("s")), computed, computed.node("m")).failure()
    assert reason.message == "self of m is not a constant (it is computed by 'conv')"


def test_a_snapshot_prints_short_whatever_its_size() -> None:
    # an outside author: printing a transform's outcome dumped both snapshots whole (about 20 KB
    # for 20 nodes)
    g = GraphBuilder(dialect="edge")
    y = g.input("x", (2, 3))
    for i in range(500):
        y = g.call("aten.relu.default", name=f"r{i}", self=y, out=(2, 3))
    g.output(y)
    snap = g.build()
    assert repr(snap) == (
        "GraphSnapshot(502 nodes: x, r0, r1, r2, r3, r4, r5, r6, ...; 0 constants; "
        "dialect='edge', lifted=True, decomposed=True)"
    )
