"""The outside author's Vulkan 4-bit linear rule (``tests/vulkan_q4linear.py``) planned on hand-built
snapshots, torch-free: the op and its arguments, the new constants (their specs, and their values
computed by a small numpy evaluator of the plan's expressions against the shader's byte layout written
out by hand), and each decline with its code and pattern path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fxpure import NodeRef, plan, verify
from fxpure.snapshot import GraphSnapshot, NodeSnapshot
from fxpure.testing import GraphBuilder, evaluate, spec
from fxpure.weights import WeightExpr, infer_spec
from tests.vulkan_q4linear import DQ_AFFINE, RULES, TARGET, q4gsw_linear

DQ = "torchao.dequantize_affine.default"


def q4(
    *,
    k: int = 64,
    n: int = 8,
    g: int = 32,
    rows: tuple[int | str, ...] = (4,),
    bias: bool = True,
    dialect: str = "edge",
    x_dtype: str = "float32",
    w_dtype: str = "int8",
    declared: tuple[int, int] = (-8, 7),
    block: tuple[int, ...] | None = None,
    scales: tuple[int, ...] | None = None,
    zeros: bool = True,
    bias_shape: tuple[int, ...] | None = None,
    weight: str = "parameter",
    output_dtype: str | None = None,
) -> GraphSnapshot:
    """x (``rows + (k,)``) -> [view_copy] -> addmm(b, ., permute_copy(dequantize_affine(W int8 [n, k],
    [1, g], scales [n, k/g], zeros [n, k/g]))) (``mm`` without a bias) -> [view_copy], as ``to_edge``
    writes a torchao int4 linear; ``dialect="aten"``: one ``aten.linear`` on the input as it is."""
    b = GraphBuilder(dialect=dialect, schemas=[DQ_AFFINE])
    w = b.input("w", (n, k), w_dtype) if weight == "input" else b.parameter("w", (n, k), w_dtype)
    s = b.parameter("s", scales or (n, k // g))
    z = b.parameter("z", scales or (n, k // g), "int8") if zeros else None
    bb = b.parameter("b", bias_shape or (n,)) if bias else None
    x = b.input("x", (*rows, k), x_dtype)
    extra: dict[str, Any] = {"output_dtype": output_dtype} if output_dtype else {}
    dq = b.call(DQ, name="dq", input=w, block_size=block or (1, g), scale=s, zero_point=z, input_dtype=w_dtype,
                quant_min=declared[0], quant_max=declared[1], out=spec(n, k, dtype=x_dtype), **extra)  # fmt: skip
    if dialect == "aten":
        b.output(b.call("aten.linear.default", name="lin", input=x, weight=dq, bias=bb, out=(*rows, n)))
        return b.build(written=["w"] if weight == "written" else [])
    m: int | str = 1
    for r in rows:
        m = m * r if isinstance(r, int) and isinstance(m, int) else "m"
    flat = x
    if len(rows) > 1:
        flat = b.call("aten.view_copy.default", name="flat", self=x, size=(m, k), out=(m, k))
    wt = b.call("aten.permute_copy.default", name="wt", self=dq, dims=(1, 0), out=spec(k, n, dtype=x_dtype))
    if bb is not None:
        y = b.call("aten.addmm.default", name="lin", self=bb, mat1=flat, mat2=wt, out=(m, n))
    else:
        y = b.call("aten.mm.default", name="lin", self=flat, mat2=wt, out=(m, n))
    if len(rows) > 1:
        y = b.call("aten.view_copy.default", name="unflat", self=y, size=(*rows, n), out=(*rows, n))
    b.output(y)
    return b.build(written=["w"] if weight == "written" else [])


def _name(arg: object) -> str:
    assert isinstance(arg, NodeRef)
    return arg.name


def _vk(snap: GraphSnapshot) -> list[NodeSnapshot]:
    return [n for n in snap.nodes if n.target.startswith("et_vk")]


def value(e: WeightExpr, data: dict[str, Any]) -> Any:
    """``e`` computed as the adapter computes it (``fxpure.testing.evaluate``), as a numpy array."""
    return np.asarray(evaluate(e, data).unwrap(), dtype=infer_spec(e).unwrap().dtype)


def shader_bytes(w: Any) -> Any:
    """The uint8 ``[N, ceil(K / 8) * 4]`` layout ``pack_q4_linear_weight__w_4x8`` reads, written out
    from its comments: nibble ``k`` of row ``n`` is bits ``4 * (k % 8)`` of uint32 word ``k // 8``
    (first byte lowest), holding ``w + 8``; a value past K is 8 (zero)."""
    n, k = w.shape
    out = np.zeros((n, -(-k // 8) * 4), dtype=np.uint8)
    for row in range(n):
        for col in range(out.shape[1] * 2):
            v = int(w[row, col]) + 8 if col < k else 8
            out[row, col // 2] |= v << (4 * (col % 2))
    return out


# --- plans --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [{}, {"rows": (1,)}, {"rows": (2, 3)}, {"bias": False}, {"k": 36, "g": 12}, {"g": 64}, {"rows": ("m",)},
     {"dialect": "aten"}, {"dialect": "aten", "rows": (1, 5)}, {"zeros": False}],
)  # fmt: skip
def test_a_torchao_int4_linear_becomes_linear_q4gsw(knobs: dict[str, Any]) -> None:
    g = q4(**knobs)
    report = plan(g, list(RULES))
    assert not report.rejections
    (p,) = report.plans
    after = verify(report.after).unwrap()
    (node,) = _vk(after)
    k, n, gs, rows = knobs.get("k", 64), 8, knobs.get("g", 32), knobs.get("rows", (4,))
    flat: tuple[Any, ...] = rows
    if knobs.get("dialect") != "aten" and len(rows) == 2:
        flat = (rows[0] * rows[1],)
    assert node.target == TARGET and node.provenance == "lin" and p.anchor == "lin"
    assert node.spec == spec(*flat, n)
    x = NodeRef("flat") if len(rows) > 1 and knobs.get("dialect") != "aten" else NodeRef("x")
    assert node.args[0] == x and node.args[3] == gs
    assert (node.args[4] if len(node.args) > 4 else None) == (NodeRef("b") if knobs.get("bias", True) else None)
    c = after.constants
    w, s = c[_name(node.args[1])], c[_name(node.args[2])]
    assert w.spec == spec(n, -(-k // 8) * 4, dtype="uint8") and s.spec == spec(k // gs, n)
    # the old weight, scales and zero points, the dequantize and the product are gone
    assert {"w", "s", "z", "dq", "lin", "wt"}.isdisjoint(after.index)
    if len(rows) > 1 and knobs.get("dialect") != "aten":  # the view after the product reads the op
        (view,) = [m for m in after.nodes if m.target == "aten.view_copy.default" and m.args[0] == NodeRef(node.name)]
        assert view.spec == spec(*rows, n) and after.outputs == (view.name,)


def test_the_packed_bytes_and_scales() -> None:
    rng = np.random.default_rng(0)
    n, k, g = 8, 36, 12
    report = plan(q4(k=k, g=g), list(RULES))
    (node,) = _vk(report.after)
    c = report.after.constants
    w_expr, s_expr = c[_name(node.args[1])].source, c[_name(node.args[2])].source
    assert w_expr is not None and s_expr is not None
    w = rng.integers(-8, 8, (n, k)).astype(np.int8)
    w[0, :4] = [-8, 7, 0, -1]
    s = rng.random((n, k // g)).astype(np.float32)
    z = np.zeros((n, k // g), dtype=np.int8)
    data = {"w": w, "s": s, "z": z}
    packed = value(w_expr, data)
    assert packed.dtype == np.uint8 and np.array_equal(packed, shader_bytes(w))
    assert packed[0, 0] == 0xF0 and packed[0, 1] == 0x78  # (-8+8) | (7+8)<<4, (0+8) | (-1+8)<<4
    assert np.array_equal(value(s_expr, data), s.T)  # the program's scales, transposed
    # a zero point is subtracted per group (exact while the values stay in 4 bits)...
    w[1, 2 * g : 3 * g] = np.clip(w[1, 2 * g : 3 * g], -5, 7)
    z[1, 2] = 3
    shifted = w.astype(np.int32)
    shifted[1, 2 * g : 3 * g] -= 3
    assert np.array_equal(value(w_expr, data), shader_bytes(shifted))
    # ...and a value it pushes out of [-8, 7] (-8 - 3) fails the packing's Within, as does a value
    # outside the declared range: the adapter declines such a plan (value-range), nothing is wrapped
    w[1, 2 * g] = -8
    assert evaluate(w_expr, data).failure().message == "needs values in [-8, 7]; 1 of them are -11 to -11"
    w[1, 2 * g], w[5, 7] = 0, 8
    z[1, 2] = 0
    assert evaluate(w_expr, data).failure().code == "value-range"
    assert q4gsw_linear.codes >= {"value-range"}  # (the rule says it may be declined so)


def test_two_linears_of_one_weight_share_its_packed_constants() -> None:
    b = GraphBuilder(dialect="edge", schemas=[DQ_AFFINE])
    w, s, z = b.parameter("w", (8, 64), "int8"), b.parameter("s", (8, 2)), b.parameter("z", (8, 2), "int8")
    dq = b.call(DQ, name="dq", input=w, block_size=(1, 32), scale=s, zero_point=z, input_dtype="int8",
                quant_min=-8, quant_max=7, out=(8, 64))  # fmt: skip
    outs = []
    for i in range(2):
        x = b.input(f"x{i}", (4, 64))
        wt = b.call("aten.permute_copy.default", name=f"wt{i}", self=dq, dims=(1, 0), out=(64, 8))
        outs.append(b.call("aten.mm.default", name=f"lin{i}", self=x, mat2=wt, out=(4, 8)))
    b.output(*outs)
    report = plan(b.build(), list(RULES))
    assert len(report.plans) == 2 and not report.rejections
    a, c = _vk(report.after)
    assert a.args[1:3] == c.args[1:3]  # one packed weight, one scales constant
    assert len([k for k in report.after.constants if k not in ("w", "s", "z")]) == 2


# --- declines -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"n": 6}, "channel-alignment", "lin.mat2/lin_t.self/dqw.input"),
        ({"g": 2}, "group-size", "lin.mat2/lin_t.self/dqw.input"),
        ({"declared": (-128, 127)}, "weight-range", "lin.mat2/lin_t.self/dqw"),
        ({"x_dtype": "float16"}, "unsupported-dtype", "lin.mat2/lin_t.self/dqw"),
        ({"output_dtype": "float16"}, "unsupported-dtype", "lin.mat2/lin_t.self/dqw"),
        ({"w_dtype": "int32"}, "unsupported-dtype", "lin.mat2/lin_t.self/dqw"),
        ({"block": (1, 16)}, "not-per-group", "lin.mat2/lin_t.self/dqw"),
        ({"scales": (8, 3)}, "not-per-group", "lin.mat2/lin_t.self/dqw"),
        ({"scales": (4, 2)}, "not-per-group", "lin.mat2/lin_t.self/dqw"),
        ({"bias_shape": (4, 8)}, "no-kernel", "lin.self"),
        ({"dialect": "aten", "rows": (2, 3)}, "batched-input", "lin.input"),
        ({"dialect": "aten", "rows": ("b", 3)}, "symbolic-shape", "lin.input"),
        ({"weight": "input"}, "not-constant", "lin.mat2/lin_t.self/dqw.input"),
        ({"weight": "written"}, "not-constant", "lin.mat2/lin_t.self/dqw.input"),
    ],
)
def test_declines(knobs: dict[str, Any], code: str, path: str) -> None:
    g = q4(**knobs)
    report = plan(g, list(RULES))
    assert not report.plans
    (no,) = report.rejections
    assert (no.reason.code, no.reason.path) == (code, path), no.reason
    assert code in q4gsw_linear.codes


def test_a_float_linear_is_no_candidate() -> None:
    b = GraphBuilder(dialect="edge")
    x, w = b.input("x", (4, 64)), b.parameter("w", (8, 64))
    wt = b.call("aten.permute_copy.default", self=w, dims=(1, 0), out=(64, 8))
    b.output(b.call("aten.mm.default", self=x, mat2=wt, out=(4, 8)))
    report = plan(b.build(), list(RULES))
    assert not report.plans and not report.rejections
