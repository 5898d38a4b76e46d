"""The outside author's ``fold-bn-into-next-conv`` rule (``tests/fold_bn_into_conv.py``) planned on
hand-built snapshots, torch-free: the new conv, the NUMBERS of its weight and bias (computed by
``fxpure.testing.evaluate`` and checked against an oracle written here from the definitions: the
folded weights by index loops, and the folded conv against the original conv run on an input by
direct loops), and each decline with its code and pattern path."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import numpy as np
import pytest

from fxpure import NodeRef, plan
from fxpure.snapshot import GraphSnapshot
from fxpure.testing import GraphBuilder, evaluate, spec
from fxpure.weights import infer_spec
from tests.fold_bn_into_conv import fold_bn_into_conv

EPS = 1e-3
STATS = ("running_mean", "running_var")
AFFINE = ("weight", "bias")


def _graph(
    *,
    rank: int = 2,
    cin: int = 4,
    oc: int = 6,
    groups: int = 1,
    kernel: int = 3,
    size: int = 7,
    stride: int = 1,
    dilation: int = 1,
    padding: int | str = 0,
    bias: bool = True,
    gamma: bool = True,
    beta: bool = True,
    dtype: str = "float32",
    dialect: str = "aten",
    transposed: bool = False,
    output_padding: int = 0,
    training: bool = False,
    bn_readers: int = 1,
    weight_input: bool = False,
) -> GraphSnapshot:
    """x -> batch norm (aten: ``batch_norm``; edge: ``_native_batch_norm_legit_no_training`` and its
    ``getitem``) -> conv (aten: ``conv{rank}d``, ``conv{rank}d.padding`` for a string padding,
    ``conv_transpose{rank}d``; edge: ``convolution``)."""
    g = GraphBuilder(dialect=dialect)
    xs = (2, cin, *(size,) * rank)
    x = g.input("x", xs, dtype)
    stats = {k: g.buffer(k, (cin,), dtype) for k in STATS}
    affine = {k: g.parameter(k, (cin,), dtype) if on else None for k, on in zip(AFFINE, (gamma, beta), strict=True)}
    if dialect == "edge":
        t = g.call(
            "aten._native_batch_norm_legit_no_training.default",
            name="bn",
            input=x,
            **affine,
            **stats,
            momentum=0.1,
            eps=EPS,
            out=(spec(*xs, dtype=dtype), spec(0, dtype=dtype), spec(0, dtype=dtype)),
        )
        y = g.getitem(t, 0, name="bn_out", out=spec(*xs, dtype=dtype))
    else:
        y = g.call(
            "aten.batch_norm.default",
            name="bn",
            input=x,
            **affine,
            **stats,
            training=training,
            momentum=0.1,
            eps=EPS,
            cudnn_enabled=False,
            out=spec(*xs, dtype=dtype),
        )
    wshape = (cin, oc // groups, *(kernel,) * rank) if transposed else (oc, cin // groups, *(kernel,) * rank)
    w = g.input("w", wshape, dtype) if weight_input else g.parameter("w", wshape, dtype)
    b = g.parameter("b", (oc,), dtype) if bias else None
    pad = padding if isinstance(padding, str) else (padding,) * rank
    p0 = padding if isinstance(padding, int) else 0
    if transposed:
        out_size = (size - 1) * stride - 2 * p0 + dilation * (kernel - 1) + output_padding + 1
    else:
        out_size = (size + 2 * p0 - dilation * (kernel - 1) - 1) // stride + 1
    ys = spec(2, oc, *(out_size,) * rank, dtype=dtype)
    common: dict[str, Any] = {"input": y, "weight": w, "bias": b, "stride": (stride,) * rank, "groups": groups}
    common["dilation"] = (dilation,) * rank
    if dialect == "edge":
        conv = g.call(
            "aten.convolution.default",
            name="conv",
            **common,
            padding=pad,
            transposed=transposed,
            output_padding=(output_padding,) * rank,
            out=ys,
        )
    elif transposed:
        target = f"aten.conv_transpose{rank}d.{'default' if rank == 1 else 'input'}"
        conv = g.call(target, name="conv", **common, padding=pad, output_padding=(output_padding,) * rank, out=ys)
    else:
        overload = "padding" if isinstance(padding, str) else "default"
        conv = g.call(f"aten.conv{rank}d.{overload}", name="conv", **common, padding=pad, out=ys)
    outs = [conv]
    for i in range(1, bn_readers):  # another reader of the batch norm's output
        outs.append(g.call("aten.relu.default", name=f"relu{i}", self=y, out=spec(*xs, dtype=dtype)))
    g.output(*outs)
    return g.build()


# --- the oracle: the definitions, in float64 -----------------------------------------------------


def _values(snap: GraphSnapshot, seed: int = 0) -> dict[str, np.ndarray]:
    """Random values for every constant of the snapshot (variances positive)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, info in snap.constants.items():
        shape = tuple(int(d) for d in info.spec.shape)
        v = rng.uniform(0.5, 1.5, shape) if key == "running_var" else rng.uniform(-1.0, 1.0, shape)
        out[key] = v
    return out


def _rounded(v: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The values as ``dtype`` holds them (what the program's tensors hold), back in float64."""
    if dtype == "float16":
        return {k: a.astype(np.float16).astype(np.float64) for k, a in v.items()}
    if dtype == "bfloat16":  # the upper 16 bits of a float32, rounded to nearest even
        out = {}
        for k, a in v.items():
            bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
            out[k] = bits.view(np.float32).astype(np.float64)
        return out
    return {k: a.astype(np.float32).astype(np.float64) for k, a in v.items()}


def _affine(v: dict[str, np.ndarray], cin: int) -> tuple[list[float], list[float]]:
    """Per input channel c: s[c] = gamma / sqrt(var + eps), t[c] = beta - mean * s[c]."""
    s, t = [], []
    for c in range(cin):
        gamma = v["weight"][c] if "weight" in v else 1.0
        beta = v["bias"][c] if "bias" in v else 0.0
        sc = gamma / math.sqrt(v["running_var"][c] + EPS)
        s.append(sc)
        t.append(beta - v["running_mean"][c] * sc)
    return s, t


def _folded_t(v: dict[str, np.ndarray], groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Transposed, W of shape (C, OC/G, k...): W'[c, j, k] = W[c, j, k] * s[c] and
    b'[g * OC/G + j] = b[...] + sum_{i, k} W[g * C/G + i, j, k] * t[g * C/G + i]."""
    w = v["w"]
    cin, ocg = w.shape[:2]
    s, t = _affine(v, cin)
    new_w, new_b = np.zeros_like(w), np.zeros(ocg * groups)
    for g, j in itertools.product(range(groups), range(ocg)):
        o = g * ocg + j
        total = float(v["b"][o]) if "b" in v else 0.0
        for i in range(cin // groups):
            c = g * (cin // groups) + i
            for k in itertools.product(*map(range, w.shape[2:])):
                new_w[(c, j, *k)] = w[(c, j, *k)] * s[c]
                total += w[(c, j, *k)] * t[c]
        new_b[o] = total
    return new_w, new_b


def _folded(v: dict[str, np.ndarray], groups: int, transposed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """W'[o, i, k] = W[o, i, k] * s[c] and b'[o] = b[o] + sum_{i, k} W[o, i, k] * t[c], where
    c = g * C/G + i for the group g = o // (OC/G) of output o: element by element."""
    if transposed:
        return _folded_t(v, groups)
    w = v["w"]
    oc, icg = w.shape[:2]
    s, t = _affine(v, icg * groups)
    new_w, new_b = np.zeros_like(w), np.zeros(oc)
    for o in range(oc):
        g = o // (oc // groups)
        total = float(v["b"][o]) if "b" in v else 0.0
        for i in range(icg):
            c = g * icg + i
            for k in itertools.product(*map(range, w.shape[2:])):
                new_w[(o, i, *k)] = w[(o, i, *k)] * s[c]
                total += w[(o, i, *k)] * t[c]
        new_b[o] = total
    return new_w, new_b


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, groups: int, stride: int, dilation: int) -> np.ndarray:
    """A conv without padding, by its definition: y[n, o, p] = b[o] + sum_{i, k} w[o, i, k] *
    x[n, g * C/G + i, p * stride + k * dilation]."""
    n, oc, icg, kernel = x.shape[0], w.shape[0], w.shape[1], w.shape[2:]
    sizes = [(d - dilation * (k - 1) - 1) // stride + 1 for d, k in zip(x.shape[2:], kernel, strict=True)]
    y = np.zeros((n, oc, *sizes))
    for bi, o in itertools.product(range(n), range(oc)):
        g = o // (oc // groups)
        for p in itertools.product(*map(range, sizes)):
            acc = float(b[o]) if b is not None else 0.0
            for i in range(icg):
                for k in itertools.product(*map(range, kernel)):
                    at = tuple(pi * stride + ki * dilation for pi, ki in zip(p, k, strict=True))
                    acc += w[(o, i, *k)] * x[(bi, g * icg + i, *at)]
            y[(bi, o, *p)] = acc
    return y


def _conv_t(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, groups: int, pad: int, dilation: int) -> np.ndarray:
    """A transposed conv of stride 1, by its definition: input position p scatters w[c, j, k] *
    x[n, c, p] to output position p + k * dilation - pad (kept where it falls in the output)."""
    n, cin, ocg, kernel = x.shape[0], w.shape[0], w.shape[1], w.shape[2:]
    icg = cin // groups
    sizes = [d - 1 - 2 * pad + dilation * (k - 1) + 1 for d, k in zip(x.shape[2:], kernel, strict=True)]
    y = np.zeros((n, ocg * groups, *sizes))
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(sizes))
    for bi, c in itertools.product(range(n), range(cin)):
        g = c // icg
        for p in itertools.product(*(range(d) for d in x.shape[2:])):
            for j in range(ocg):
                for k in itertools.product(*map(range, kernel)):
                    at = tuple(pi + ki * dilation - pad for pi, ki in zip(p, k, strict=True))
                    if all(0 <= a < sz for a, sz in zip(at, sizes, strict=True)):
                        y[(bi, g * ocg + j, *at)] += w[(c, j, *k)] * x[(bi, c, *p)]
    return y


def _bn(x: np.ndarray, v: dict[str, np.ndarray]) -> np.ndarray:
    """The batch norm as torch defines it: (x - mean) / sqrt(var + eps) * gamma + beta."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y: np.ndarray = (x - v["running_mean"].reshape(shape)) / np.sqrt(v["running_var"].reshape(shape) + EPS)
    if "weight" in v:
        y = y * v["weight"].reshape(shape)
    if "bias" in v:
        y = y + v["bias"].reshape(shape)
    return y


def _evaluated(snap: GraphSnapshot, v: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, str]:
    """The plan's new weight and bias, computed by fxpure.testing.evaluate, and their dtype."""
    (p,) = plan(snap, [fold_bn_into_conv]).plans
    exprs = {c.name: c.expr for c in p.constants}
    assert set(exprs) == {"conv_bnin_weight", "conv_bnin_bias"}
    given = {k: a.tolist() for k, a in v.items()}
    w = np.array(evaluate(exprs["conv_bnin_weight"], given).unwrap(), dtype=np.float64)
    b = np.array(evaluate(exprs["conv_bnin_bias"], given).unwrap(), dtype=np.float64)
    dtypes = {infer_spec(e).unwrap().dtype for e in exprs.values()}
    assert len(dtypes) == 1
    return w, b, dtypes.pop()


CASES = [
    pytest.param({}, id="conv2d"),
    pytest.param({"rank": 1, "kernel": 5}, id="conv1d"),
    pytest.param({"rank": 3, "size": 4, "kernel": 2, "cin": 2, "oc": 3}, id="conv3d"),
    pytest.param({"groups": 2}, id="grouped"),
    pytest.param({"groups": 2, "oc": 4, "cin": 6, "kernel": 2}, id="grouped-3-in-2-out"),
    pytest.param({"groups": 4, "oc": 8}, id="depthwise-x2"),
    pytest.param({"groups": 4, "oc": 4, "rank": 1}, id="depthwise-conv1d"),
    pytest.param({"bias": False}, id="no-conv-bias"),
    pytest.param({"gamma": False, "beta": False}, id="no-affine"),
    pytest.param({"gamma": False}, id="no-gamma"),
    pytest.param({"beta": False, "bias": False}, id="no-beta-no-bias"),
    pytest.param({"stride": 2, "dilation": 2}, id="strided-dilated"),
    pytest.param({"dialect": "edge", "groups": 2}, id="edge"),
    pytest.param({"padding": "valid"}, id="valid"),
    pytest.param({"padding": "same", "kernel": 1}, id="same-1x1"),
    pytest.param({"transposed": True, "kernel": 1, "padding": 1}, id="transposed-1x1-cropped"),
    pytest.param({"transposed": True, "padding": 2, "groups": 2}, id="transposed-grouped"),
    pytest.param({"transposed": True, "padding": 4, "dilation": 2, "rank": 1, "oc": 4}, id="transposed-1d-dilated"),
    pytest.param({"transposed": True, "padding": 2, "dialect": "edge", "bias": False}, id="transposed-edge"),
]


@pytest.mark.parametrize("knobs", CASES)
def test_the_folded_weight_and_bias_are_the_definition_s_numbers(knobs: dict[str, Any]) -> None:
    snap = _graph(**knobs)
    v = _rounded(_values(snap), "float32")
    got_w, got_b, dtype = _evaluated(snap, v)
    want_w, want_b = _folded(v, knobs.get("groups", 1), knobs.get("transposed", False))
    assert dtype == "float32" and got_w.shape == want_w.shape and got_b.shape == want_b.shape
    # float32: s is five roundings (add, sqrt, div, mul) from exact, W * s one more; a sum within its terms
    assert np.allclose(got_w, want_w, rtol=2**-21, atol=0)
    assert np.allclose(got_b, want_b, rtol=0, atol=2**-20 * float(np.abs(v["w"]).sum()))


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({"rank": 1, "groups": 2, "kernel": 3, "stride": 2}, id="conv1d-grouped-strided"),
        pytest.param({"groups": 2, "oc": 4, "size": 5, "dilation": 2, "bias": False}, id="conv2d-dilated-no-bias"),
        pytest.param({"groups": 4, "oc": 4, "size": 5, "beta": False}, id="depthwise"),
        pytest.param({"transposed": True, "groups": 2, "size": 5, "padding": 2}, id="transposed-grouped"),
        pytest.param({"transposed": True, "rank": 1, "padding": 3, "dilation": 3, "kernel": 2}, id="transposed-1d"),
        pytest.param({"transposed": True, "kernel": 1, "padding": 1, "size": 5}, id="transposed-1x1-cropped"),
    ],
)
def test_the_folded_conv_of_x_computes_the_conv_of_the_batch_norm_of_x(knobs: dict[str, Any]) -> None:
    # independent of any formula for W' and b': both convs run, by their definition, on one input
    snap = _graph(**knobs)
    v = _rounded(_values(snap, seed=3), "float32")
    new_w, new_b, _ = _evaluated(snap, v)
    x_spec = snap.node("x").tensor_spec
    assert x_spec is not None
    x = np.random.default_rng(4).normal(size=tuple(int(d) for d in x_spec.shape))
    groups, stride, dilation = knobs.get("groups", 1), knobs.get("stride", 1), knobs.get("dilation", 1)
    if knobs.get("transposed"):
        pad = knobs["padding"]
        want = _conv_t(_bn(x, v), v["w"], v.get("b"), groups, pad, dilation)
        got = _conv_t(x, new_w, new_b, groups, pad, dilation)
    else:
        want = _conv(_bn(x, v), v["w"], v.get("b"), groups, stride, dilation)
        got = _conv(x, new_w, new_b, groups, stride, dilation)
    assert np.allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize(("dtype", "bits"), [("float16", 10), ("bfloat16", 7), ("float64", 48)])
def test_half_precision_is_computed_in_float32_and_rounded_once(dtype: str, bits: int) -> None:
    snap = _graph(dtype=dtype, groups=2)
    v = _rounded(_values(snap, seed=1), dtype)
    got_w, got_b, got_dtype = _evaluated(snap, v)
    want_w, want_b = _folded(v, 2)
    assert got_dtype == dtype
    # one rounding to dtype of a value computed in float32 (float64: a few roundings of its own, in any order)
    ulp = 2.0**-bits
    assert np.allclose(got_w, want_w, rtol=ulp * (1.0 + 2**-10), atol=0)
    assert np.allclose(got_b, want_b, rtol=ulp, atol=ulp * float(np.abs(want_b).max()))


def test_the_plan_reads_x_and_erases_the_batch_norm() -> None:
    for dialect, erased in (("aten", {"conv", "bn"}), ("edge", {"conv", "bn", "bn_out"})):
        report = plan(_graph(dialect=dialect, groups=2), [fold_bn_into_conv])
        (p,) = report.plans
        assert not report.rejections and set(p.erase) == erased and p.replace == (("conv", "conv_bnin"),)
        (conv,) = p.nodes
        want = "aten.conv2d.default" if dialect == "aten" else "aten.convolution.default"
        assert conv.target == want and conv.args[:3] == (
            NodeRef("x"),
            NodeRef("conv_bnin_weight"),
            NodeRef("conv_bnin_bias"),
        )
        # the program's weight is read, not written: it is a source of the new constants only
        assert {c.kind for c in p.constants} == {"parameter"}


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"padding": 1}, "conv-padding", "conv.padding"),
        ({"padding": 1, "dialect": "edge"}, "conv-padding", "conv.padding"),
        ({"padding": "same"}, "conv-padding", "conv.padding"),
        ({"transposed": True}, "transposed-conv", "conv.padding"),
        ({"transposed": True, "padding": 1}, "transposed-conv", "conv.padding"),
        ({"transposed": True, "dialect": "edge", "groups": 2}, "transposed-conv", "conv.padding"),
        ({"transposed": True, "kernel": 1, "stride": 2}, "transposed-conv", "conv.stride"),
        (
            {"transposed": True, "padding": 2, "dilation": 2, "output_padding": 1},
            "transposed-conv",
            "conv.output_padding",
        ),
        ({"transposed": True, "padding": 3, "dilation": 2}, "transposed-conv", "conv.padding"),
        ({"training": True}, "bn-training-mode", "conv.input/bn.training"),
        ({"bn_readers": 2}, "output-shared", "conv.input/bn"),
        ({"weight_input": True}, "not-constant", "conv.weight"),
        ({"dtype": "int32"}, "unsupported-dtype", "conv.weight"),
    ],
)
def test_what_cannot_fold_exactly_is_declined_saying_where(knobs: dict[str, Any], code: str, path: str) -> None:
    report = plan(_graph(**knobs), [fold_bn_into_conv])
    (no,) = report.rejections
    assert not report.plans and (no.node, no.reason.code, no.reason.path) == ("conv", code, path)
    assert code in fold_bn_into_conv.codes


def test_a_conv_of_anything_but_a_batch_norm_is_declined_wrong_op() -> None:
    g = GraphBuilder()
    x = g.input("x", (1, 4, 5, 5))
    r = g.call("aten.relu.default", name="relu", self=x, out=(1, 4, 5, 5))
    g.output(
        g.call("aten.conv2d.default", name="conv", input=r, weight=g.parameter("w", (2, 4, 1, 1)), out=(1, 2, 5, 5))
    )
    (no,) = plan(g.build(), [fold_bn_into_conv]).rejections
    assert (no.reason.code, no.reason.path) == ("wrong-op", "conv.input/bn")


def test_evaluate_rejects_a_value_missing_or_of_another_shape() -> None:
    snap = _graph()
    (p,) = plan(snap, [fold_bn_into_conv]).plans
    v = {k: a.tolist() for k, a in _values(snap).items()}
    del v["running_var"]
    assert evaluate(p.constants[0].expr, v).failure().code == "bad-weight-expr"
    v["running_var"] = [1.0] * 3
    assert evaluate(p.constants[0].expr, v).failure().code == "bad-weight-expr"


def test_random_grouped_convs_against_the_oracle() -> None:
    rnd = random.Random(7)
    for _ in range(16):
        groups = rnd.choice((1, 2, 3))
        transposed = rnd.random() < 0.4
        knobs: dict[str, Any] = {
            "rank": rnd.choice((1, 2)),
            "groups": groups,
            "cin": groups * rnd.randint(1, 3),
            "oc": groups * rnd.randint(1, 3),
            "kernel": rnd.randint(1, 3),
            "size": 4,
            "bias": rnd.random() < 0.5,
            "gamma": rnd.random() < 0.7,
            "beta": rnd.random() < 0.7,
            "transposed": transposed,
        }
        if transposed:  # (size 5: an output of one position or more)
            knobs.update(padding=knobs["kernel"] - 1 + rnd.randint(0, 1), size=5)
        snap = _graph(**knobs)
        v = _rounded(_values(snap, seed=rnd.randint(0, 99)), "float32")
        got_w, got_b, _ = _evaluated(snap, v)
        want_w, want_b = _folded(v, groups, transposed)
        assert np.allclose(got_w, want_w, rtol=2**-21, atol=0), knobs
        assert np.allclose(got_b, want_b, rtol=0, atol=2**-20 * float(np.abs(v["w"]).sum())), knobs
