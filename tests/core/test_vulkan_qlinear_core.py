"""The outside author's Vulkan int8 linear rules (``tests/vulkan_qlinear.py``) planned on hand-built
edge snapshots, torch-free: each kernel and plan shape, the new constants (the program's own left as
they are), and each decline with its code and pattern path."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from fxpure import NodeRef, plan, verify
from fxpure.snapshot import DTypeArg, GraphSnapshot, NodeSnapshot
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import PadTo, Source, SumOver
from tests.vulkan_qlinear import RULES, linear_q8ta_q8csw, q8ta_linear

I8 = DTypeArg("int8")
QD = "quantized_decomposed"


def _q(x: NodeRef, scale: float, zero: int, low: int = -128, high: int = 127, dtype: str = "int8") -> dict[str, Any]:
    return {
        "input": x,
        "scale": scale,
        "zero_point": zero,
        "quant_min": low,
        "quant_max": high,
        "dtype": DTypeArg(dtype),
    }


def qlinear(
    *,
    k: int = 8,
    n: int = 6,
    shape: tuple[int, ...] = (4,),
    bias: bool = True,
    relu: bool = False,
    out: str | None = "q",
    out_range: tuple[int, int] = (-128, 127),
    per_channel: bool = True,
    axis: int = 0,
    zeros: tuple[int, ...] | None = None,
    w_range: tuple[int, int] = (-127, 127),
    act: str = "int8",
    weight: str = "buffer",
    bias_shape: tuple[int, ...] | None = None,
    linears: int = 1,
    dynamic: bool = False,
) -> GraphSnapshot:
    """int8 x (``shape + (k,)``) -> dq -> addmm(b, ., permute(dq(int8 W (n, k)))) (``mm`` without a
    bias; flattened and unflattened around it for a rank > 2 input) -> [relu] -> q, ``linears`` times
    in a row (``n == k``) on one weight, as to_edge writes PT2E's nn.Linear."""
    g = GraphBuilder(dialect="edge")
    scales = g.buffer("scales", (n,), key="s")
    zp = g.buffer("zp", (n,), "int64", key="z", values=zeros or (0,) * n)
    w = g.input("w", (n, k), "int8") if weight == "input" else g.buffer("w", (n, k), "int8")
    b = g.parameter("b", bias_shape or (n,)) if bias else None
    prev = g.input("x", (*shape, k), act)
    rows = 1
    for d in shape:
        rows *= d
    for i in range(linears):
        if dynamic:  # parameters computed at run time (given here): a dynamically quantized input
            qp = {"scale": g.input(f"xs{i}", ()), "zero_point": g.input(f"xz{i}", (), "int64")}
            dqx = g.call(
                f"{QD}.dequantize_per_tensor.tensor", name=f"dqx{i}", out=(*shape, k), **{**_q(prev, 0, 0), **qp}
            )
        else:
            dqx = g.call(
                f"{QD}.dequantize_per_tensor.default", name=f"dqx{i}", out=(*shape, k), **_q(prev, 0.02, 3, dtype=act)
            )
        if per_channel:
            wq = {**_q(w, 0.0, 0, *w_range), "scale": scales, "zero_point": zp, "axis": axis}
            dqw = g.call(f"{QD}.dequantize_per_channel.default", name=f"dqw{i}", out=(n, k), **wq)
        else:
            dqw = g.call(f"{QD}.dequantize_per_tensor.default", name=f"dqw{i}", out=(n, k), **_q(w, 0.01, 0, *w_range))
        wt = g.call("aten.permute_copy.default", name=f"wt{i}", self=dqw, dims=(1, 0), out=(k, n))
        flat = dqx
        if len(shape) > 1:
            flat = g.call("aten.view_copy.default", name=f"flat{i}", self=dqx, size=(rows, k), out=(rows, k))
        name = f"lin{i}"
        if bias:
            y = g.call("aten.addmm.default", name=name, self=b, mat1=flat, mat2=wt, out=(rows, n))
        else:
            y = g.call("aten.mm.default", name=name, self=flat, mat2=wt, out=(rows, n))
        if len(shape) > 1:
            y = g.call("aten.view_copy.default", name=f"unflat{i}", self=y, size=(*shape, n), out=(*shape, n))
        if relu:
            y = g.call("aten.relu.default", name=f"relu{i}", self=y, out=(*shape, n))
        if out == "q":
            y = g.call(f"{QD}.quantize_per_tensor.default", name=f"q{i}", out=spec(*shape, n, dtype="int8"),
                       **_q(y, 0.05, -1, *out_range))  # fmt: skip
        prev = y
    g.output(prev)
    return g.build(written=["w"] if weight == "written" else [])


def _vk(snap: GraphSnapshot) -> list[NodeSnapshot]:
    return [n for n in snap.nodes if n.target.startswith("et_vk")]


def _w() -> Source:
    return Source(key="w", spec=spec(6, 8, dtype="int8"))


@pytest.mark.parametrize(
    ("knobs", "op"),
    [
        ({}, "et_vk.q8ta_linear.default"),
        ({"shape": (1,)}, "et_vk.q8ta_linear_gemv.default"),  # one row: the gemv kernel, as upstream
        ({"shape": (1, 5)}, "et_vk.q8ta_linear.default"),  # nn.Linear on (1, 5, 8): the 3-D input as it is
        ({"shape": (1, 1, 1)}, "et_vk.q8ta_linear_gemv.default"),
        ({"bias": False, "relu": True}, "et_vk.q8ta_linear.default"),
    ],
)
def test_a_quantized_linear_becomes_a_q8ta_linear(knobs: dict[str, Any], op: str) -> None:
    g = qlinear(**knobs)
    report = plan(g, list(RULES))
    assert not report.rejections
    (p,) = report.plans
    after = verify(report.after).unwrap()
    (node,) = _vk(after)
    shape, k = knobs.get("shape", (4,)), 8
    assert node.target == op and node.spec == spec(*shape, 6, dtype="int8") and node.provenance == "lin0"
    # x, input scale and zero point; the weight as it is; sums, scales; output scale and zero point
    assert node.args[:5] == (NodeRef("x"), 0.02, 3, NodeRef("w"), NodeRef("w_sums"))
    assert node.args[5:8] == (NodeRef("scales_padded"), 0.05, -1)
    bias = NodeRef("b_padded") if knobs.get("bias", True) else None
    assert node.args[8:] == (bias, "relu" if knobs.get("relu") else "none")
    # new constants, padded to 4: the program's scales, bias and zero points, and every dq, go
    c = after.constants
    assert c["w_sums"].source == PadTo(x=SumOver(x=_w(), dims=(1,), dtype="int32"), dim=0, multiple=4)
    assert c["w_sums"].spec == spec(8, dtype="int32") and c["scales_padded"].spec == spec(8)
    assert c["scales_padded"].source == PadTo(x=Source(key="scales", spec=spec(6)), dim=0, multiple=4)
    assert {"scales", "zp", "b", "dqx0", "dqw0", "wt0", "lin0", "q0"}.isdisjoint(after.index)
    assert p.anchor == "q0" and p.rule == q8ta_linear.name and k % 4 == 0


def test_aligned_outputs_read_the_programs_scales_and_bias_as_they_are() -> None:
    after = plan(qlinear(n=8), list(RULES)).after
    (node,) = _vk(after)
    assert node.args[5] == NodeRef("scales") and node.args[8] == NodeRef("b")
    w = Source(key="w", spec=spec(8, 8, dtype="int8"))
    assert after.constants["w_sums"].source == SumOver(x=w, dims=(1,), dtype="int32")
    assert after.constants["scales"].source is None


@pytest.mark.parametrize("n", [6, 8])
def test_an_output_not_quantized_becomes_a_linear_q8ta_q8csw_of_the_float_input(n: int) -> None:
    report = plan(qlinear(out=None, n=n), list(RULES))
    (p,) = report.plans
    assert not report.rejections and p.rule == linear_q8ta_q8csw.name and p.anchor == "lin0"
    after = verify(report.after).unwrap()
    (node,) = _vk(after)
    # the op quantizes its float input itself: it reads the dequantize
    assert node.target == "et_vk.linear_q8ta_q8csw.default" and node.args[0] == NodeRef("dqx0")
    assert node.args[1:5] == (0.02, 3, NodeRef("w"), NodeRef("w_sums")) and node.spec == spec(4, n)
    if n == 8:
        assert node.args[5:] == (NodeRef("scales"), NodeRef("b"))
    else:  # its reference (its meta) adds the bias unsliced: the program's bias is added after it
        assert node.args[5:] == (NodeRef("scales_padded"),)
        (add,) = [m for m in after.nodes if m.target == "aten.add.Tensor"]
        assert add.args == (NodeRef(node.name), NodeRef("b")) and after.outputs == (add.name,)


def test_a_narrower_output_range_takes_the_float_output_kernel_and_keeps_the_quantize() -> None:
    report = plan(qlinear(out_range=(-127, 127)), list(RULES))
    (no,) = report.rejections
    assert (no.rule, no.reason.code, no.reason.path) == (q8ta_linear.name, "no-kernel", "q")
    (p,) = report.plans
    after = verify(report.after).unwrap()
    assert p.rule == linear_q8ta_q8csw.name and [n.target for n in _vk(after)] == ["et_vk.linear_q8ta_q8csw.default"]
    assert "q0" in after.index


def test_chained_linears_each_read_the_one_before() -> None:
    # ET PR #17567: a rewrite rewired the next match's input and it read the wrong qparams; here each
    # plan is made on the snapshot, and the second reads the first's new node, with its own qparams
    report = plan(qlinear(n=8, linears=3), list(RULES))
    assert not report.rejections and len(report.plans) == 3
    first, second, third = _vk(verify(report.after).unwrap())
    assert second.args[:3] == (NodeRef(first.name), 0.02, 3) and third.args[0] == NodeRef(second.name)
    assert [n.args[6:8] for n in (first, second, third)] == [(0.05, -1)] * 3


def test_two_linears_of_one_weight_share_its_new_constants() -> None:
    g = GraphBuilder(dialect="edge")
    scales = g.buffer("scales", (6,), key="s")
    zp = g.buffer("zp", (6,), "int64", key="z", values=(0,) * 6)
    w = g.buffer("w", (6, 8), "int8")
    outs = []
    for i in range(2):
        x = g.input(f"x{i}", (4, 8), "int8")
        dqx = g.call(f"{QD}.dequantize_per_tensor.default", name=f"dqx{i}", out=(4, 8), **_q(x, 0.02, 3))
        dqw = g.call(f"{QD}.dequantize_per_channel.default", name=f"dqw{i}", out=(6, 8),
                     **{**_q(w, 0.0, 0, -127), "scale": scales, "zero_point": zp, "axis": 0})  # fmt: skip
        wt = g.call("aten.permute_copy.default", name=f"wt{i}", self=dqw, dims=(1, 0), out=(8, 6))
        y = g.call("aten.mm.default", name=f"lin{i}", self=dqx, mat2=wt, out=(4, 6))
        outs.append(g.call(f"{QD}.quantize_per_tensor.default", name=f"q{i}", out=spec(4, 6, dtype="int8"),
                           **_q(y, 0.05, -1)))  # fmt: skip
    g.output(*outs)
    report = plan(g.build(), list(RULES))
    after = verify(report.after).unwrap()
    a, b = _vk(after)
    assert len(report.plans) == 2 and a.args[3:6] == b.args[3:6]
    assert {k for k in after.constants} == {"w", "w_sums", "scales_padded"}


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"k": 6}, "channel-alignment", "q.input/lin.mat2/lin_t.self/dqw.input"),
        ({"per_channel": False}, "not-per-channel", "q.input/lin.mat2/lin_t.self/dqw"),
        ({"axis": 1}, "not-per-channel", "q.input/lin.mat2/lin_t.self/dqw"),
        ({"zeros": (0, 0, 1, 0, 0, 0)}, "asymmetric-weight", "q.input/lin.mat2/lin_t.self/dqw"),
        ({"w_range": (-200, 127)}, "weight-range", "q.input/lin.mat2/lin_t.self/dqw"),
        ({"act": "uint8"}, "unsupported-dtype", "q.input/lin.mat1/dqx"),
        ({"weight": "input"}, "not-constant", "q.input/lin.mat2/lin_t.self/dqw.input"),
        ({"weight": "written"}, "not-constant", "q.input/lin.mat2/lin_t.self/dqw.input"),  # trained in place
        ({"shape": (2, 3)}, "batched-input", "q.input/lin_out.self/lin.mat1/lin_in.self/dqx.input"),
        ({"bias_shape": (1, 6)}, "no-kernel", "q.input/lin.self"),
        ({"dynamic": True}, "not-scalar", "q.input/lin.mat1/dqx.scale"),
    ],
)
def test_what_no_kernel_takes_is_declined_saying_where(knobs: dict[str, Any], code: str, path: str) -> None:
    report = plan(qlinear(**knobs), list(RULES))
    assert not report.plans
    # both rules say so: the output quantize's, then the linear's (its path one step shorter)
    first, second = report.rejections
    assert (first.rule, first.node, first.reason.code, first.reason.path) == (q8ta_linear.name, "q0", code, path)
    assert (second.rule, second.reason.code, second.reason.path) == (
        linear_q8ta_q8csw.name,
        code,
        path.removeprefix("q.input/").replace("lin_out.self/", ""),
    )


def test_a_relu_read_elsewhere_keeps_the_quantize_and_takes_the_float_output_kernel() -> None:
    # q(relu(linear)) where the relu is an output too: the quantize's rule declines (output-shared),
    # the linear's rewrites the linear alone
    report = plan(qlinear_relu_output(), list(RULES))
    (no,) = report.rejections
    assert (no.rule, no.node, no.reason.code, no.reason.path) == (
        q8ta_linear.name,
        "q0",
        "output-shared",
        "q.input/relu",
    )
    (p,) = report.plans
    assert p.rule == linear_q8ta_q8csw.name and {"relu0", "q0"} <= set(verify(report.after).unwrap().index)


def qlinear_relu_output() -> GraphSnapshot:
    g = GraphBuilder(dialect="edge")
    scales, zp = g.buffer("scales", (8,)), g.buffer("zp", (8,), "int64", values=(0,) * 8)
    w, x = g.buffer("w", (8, 8), "int8"), g.input("x", (4, 8), "int8")
    dqx = g.call(f"{QD}.dequantize_per_tensor.default", name="dqx0", out=(4, 8), **_q(x, 0.02, 3))
    dqw = g.call(f"{QD}.dequantize_per_channel.default", name="dqw0", out=(8, 8),
                 **{**_q(w, 0.0, 0, -127), "scale": scales, "zero_point": zp, "axis": 0})  # fmt: skip
    wt = g.call("aten.permute_copy.default", name="wt0", self=dqw, dims=(1, 0), out=(8, 8))
    y = g.call("aten.relu.default", name="relu0", out=(4, 8),
               self=g.call("aten.mm.default", name="lin0", self=dqx, mat2=wt, out=(4, 8)))  # fmt: skip
    g.output(y, g.call(f"{QD}.quantize_per_tensor.default", name="q0", out=spec(4, 8, dtype="int8"), **_q(y, 0.05, -1)))
    return g.build()


def test_a_weight_only_quantized_linear_is_declined_not_quantized() -> None:
    # a float input (upstream's q4gsw / weight-only kernels, not these): the quantize's rule says so
    g = GraphBuilder(dialect="edge")
    scales, zp = g.buffer("scales", (8,)), g.buffer("zp", (8,), "int64", values=(0,) * 8)
    w, x = g.buffer("w", (8, 8), "int8"), g.input("x", (4, 8))
    dqw = g.call(f"{QD}.dequantize_per_channel.default", name="dqw0", out=(8, 8),
                 **{**_q(w, 0.0, 0, -127), "scale": scales, "zero_point": zp, "axis": 0})  # fmt: skip
    wt = g.call("aten.permute_copy.default", name="wt0", self=dqw, dims=(1, 0), out=(8, 8))
    y = g.call("aten.mm.default", name="lin0", self=x, mat2=wt, out=(4, 8))
    g.output(g.call(f"{QD}.quantize_per_tensor.default", name="q0", out=spec(4, 8, dtype="int8"), **_q(y, 0.05, -1)))
    report = plan(g.build(), list(RULES))
    first, second = report.rejections
    assert not report.plans
    assert (first.rule, first.reason.code, first.reason.path) == (
        q8ta_linear.name,
        "not-quantized",
        "q.input/lin.self/dqx",
    )
    # (linear_root lists the flattened spellings first: its near miss names a flatten this graph has not)
    assert (second.rule, second.reason.code, second.reason.path) == (
        linear_q8ta_q8csw.name,
        "wrong-op",
        "lin.self/lin_in",
    )


def test_a_float_linear_is_no_candidate() -> None:
    g = GraphBuilder(dialect="edge")
    x, w = g.input("x", (4, 8)), g.parameter("w", (6, 8))
    wt = g.call("aten.permute_copy.default", name="wt", self=w, dims=(1, 0), out=(8, 6))
    g.output(g.call("aten.mm.default", name="mm", self=x, mat2=wt, out=(4, 6)))
    report = plan(g.build(), list(RULES))
    assert not report.plans and not report.rejections


def test_the_rules_and_this_test_import_no_torch() -> None:
    code = "import sys, tests.core.test_vulkan_qlinear_core; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
