"""The outside author's ``addmm-to-linear`` rule (``tests/addmm_to_linear.py``) planned on hand-built
snapshots, torch-free: the linear it writes for each spelling of the transpose, in aten and edge
form, beta and alpha folded into new constants, and each decline, located."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fxpure import NodeRef, plan
from fxpure.testing import GraphBuilder, spec
from fxpure.weights import Binary, Cast, Fill, Source
from tests.addmm_to_linear import addmm_to_linear

Spelling = tuple[str, dict[str, int | tuple[int, ...]]]
# (the transpose spelled as export, run_decompositions and to_edge write it)
SPELLINGS: dict[str, Spelling] = {
    "t": ("aten.t.default", {}),
    "permute": ("aten.permute.default", {"dims": (1, 0)}),
    "permute_neg": ("aten.permute.default", {"dims": (-1, -2)}),
    "transpose": ("aten.transpose.int", {"dim0": 0, "dim1": 1}),
    "transpose_neg": ("aten.transpose.int", {"dim0": -1, "dim1": 0}),
}


def _graph(
    *,
    bias: str | None = "param",
    t: Spelling = SPELLINGS["t"],
    dialect: str = "aten",
    dtype: str = "float32",
    bias_shape: tuple[int, ...] = (6,),
    weight: str = "param",
    **scales: float,
) -> GraphBuilder:
    """``addmm(b, x, t(W), **scales)`` (``mm(x, t(W))`` without a bias), x (4, 8), W (6, 8)."""
    g = GraphBuilder(dialect=dialect)
    x = g.input("x", (4, 8), dtype)
    w = g.parameter("w", (6, 8), dtype) if weight == "param" else g.input("w", (6, 8), dtype)
    target, dims = t
    wt = g.call(target, name="wt", self=w, out=spec(8, 6, dtype=dtype), **dims)
    if bias is None:
        g.output(g.call("aten.mm.default", name="mm", self=x, mat2=wt, out=spec(4, 6, dtype=dtype)))
        return g
    b = (
        g.parameter("b", bias_shape, dtype)
        if bias == "param"
        else g.call("aten.relu.default", name="b", self=g.input("c", bias_shape, dtype), out=spec(*bias_shape))
    )
    g.output(g.call("aten.addmm.default", name="mm", self=b, mat1=x, mat2=wt, out=spec(4, 6, dtype=dtype), **scales))
    return g


def _source(g: GraphBuilder, key: str) -> Source:
    return Source(key=key, spec=g.build().constants[key].spec)


@pytest.mark.parametrize("dialect", ["aten", "edge"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("bias", ["param", None])
def test_a_product_of_a_transposed_weight_becomes_a_linear_of_the_weight(
    bias: str | None, spelling: str, dialect: str
) -> None:
    target, dims = SPELLINGS[spelling]
    if dialect == "edge":  # (edge holds the copies)
        target = target.replace("permute", "permute_copy").replace("transpose.", "transpose_copy.")
        target = target.replace("aten.t.", "aten.t_copy.")
    report = plan(_graph(bias=bias, t=(target, dims), dialect=dialect).build(), [addmm_to_linear])
    (p,) = report.plans
    # the transpose, which tied weights may share, dropped once nothing reads it
    assert not report.rejections and (p.erase, p.prune) == (("mm",), ("wt",)) and not p.constants
    (linear,) = p.nodes
    assert linear.target == "aten.linear.default" and linear.spec == spec(4, 6)
    # linear(input, weight, bias): W read as the program holds it, no new constant
    assert linear.args[:2] == (NodeRef("x"), NodeRef("w"))
    assert (linear.args[2:] or (None,))[0] == (NodeRef("b") if bias else None)
    assert p.replace == (("mm", linear.name),)


@pytest.mark.parametrize("own", [True, False])
def test_a_flattened_input_is_read_as_it_is_where_the_reshapes_are_the_linears_own(own: bool) -> None:
    # edge's nn.Linear on (2, 3, 8): view_copy -> addmm -> view_copy; a model's own
    # fc(x.reshape(-1, 8)).reshape(3, 2, 6) keeps its reshapes, and the linear reads the flattened x
    g = GraphBuilder(dialect="edge")
    x, w, b = g.input("x", (2, 3, 8)), g.parameter("w", (6, 8)), g.parameter("b", (6,))
    flat = g.call("aten.view_copy.default", name="flat", self=x, size=(6, 8), out=(6, 8))
    wt = g.call("aten.permute_copy.default", name="wt", self=w, dims=(1, 0), out=(8, 6))
    mm = g.call("aten.addmm.default", name="mm", self=b, mat1=flat, mat2=wt, out=(6, 6))
    shape = (2, 3, 6) if own else (3, 2, 6)
    g.output(g.call("aten.view_copy.default", name="out", self=mm, size=shape, out=shape))
    report = plan(g.build(), [addmm_to_linear])
    (p,) = report.plans
    (linear,) = p.nodes
    assert not report.rejections and linear.target == "aten.linear.default"
    if own:
        assert linear.args == (NodeRef("x"), NodeRef("w"), NodeRef("b")) and linear.spec == spec(2, 3, 6)
        # (the flatten and the transpose, which other nodes may read, dropped once nothing does)
        assert (set(p.erase), set(p.prune), p.replace) == ({"mm", "out"}, {"flat", "wt"}, (("out", linear.name),))
    else:
        assert linear.args == (NodeRef("flat"), NodeRef("w"), NodeRef("b")) and linear.spec == spec(6, 6)
        assert (p.erase, p.replace) == (("mm",), (("mm", linear.name),))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_beta_and_alpha_are_folded_into_the_bias_and_the_weight(dtype: str) -> None:
    g = _graph(beta=0.5, alpha=0.3, dtype=dtype)
    report = plan(g.build(), [addmm_to_linear])
    (p,) = report.plans
    (linear,) = p.nodes
    assert linear.args == (NodeRef("x"), NodeRef("mm_linear_weight"), NodeRef("mm_linear_bias"))

    def scaled(key: str, by: float) -> Binary | Cast:
        # computed in float32, rounded once to the weight's dtype
        src = _source(g, key) if dtype == "float32" else Cast(x=_source(g, key), dtype="float32")
        product = Binary(op="mul", a=src, b=Fill(shape=(), value=by, dtype="float32"))
        return product if dtype == "float32" else Cast(x=product, dtype=dtype)

    want = {"mm_linear_weight": scaled("w", 0.3), "mm_linear_bias": scaled("b", 0.5)}
    assert {c.name: c.expr for c in p.constants} == want


@pytest.mark.parametrize("bias", ["param", "relu"])
def test_beta_zero_drops_the_bias_whatever_it_is(bias: str) -> None:
    # addmm ignores its self for beta=0 (a NaN in it stays out): a bias computed at run time, of
    # any shape, or a constant, is simply not read
    report = plan(_graph(bias=bias, bias_shape=(4, 6), beta=0).build(), [addmm_to_linear])
    (p,) = report.plans
    (linear,) = p.nodes
    assert linear.args[:2] == (NodeRef("x"), NodeRef("w")) and (linear.args[2:] or (None,))[0] is None
    assert not p.constants


@pytest.mark.parametrize(
    ("knobs", "code", "path"),
    [
        ({"t": ("aten.permute.default", {"dims": (0, 1)})}, "not-a-transpose", "lin.mat2/lin_t"),
        ({"t": ("aten.permute.default", {"dims": (-2, 1)})}, "not-a-transpose", "lin.mat2/lin_t"),
        ({"t": ("aten.transpose.int", {"dim0": 1, "dim1": -1})}, "not-a-transpose", "lin.mat2/lin_t"),
        ({"alpha": 0}, "alpha-zero", "lin.alpha"),
        ({"bias_shape": (1, 6)}, "bias-not-vector", "lin.self"),
        ({"bias_shape": (4, 6)}, "bias-not-vector", "lin.self"),
        ({"bias": "relu", "beta": 2.0}, "bias-not-scalable", "lin.self"),
        ({"weight": "input"}, "not-constant", "lin.mat2/lin_t.self"),
        ({"dtype": "int32"}, "unsupported-dtype", "lin.mat2/lin_t.self"),
    ],
)
def test_what_is_no_linear_is_declined_saying_where(knobs: dict[str, object], code: str, path: str) -> None:
    report = plan(_graph(**knobs).build(), [addmm_to_linear])  # type: ignore[arg-type]
    (no,) = report.rejections
    assert not report.plans and (no.node, no.reason.code, no.reason.path) == ("mm", code, path)


def test_a_product_of_no_transpose_is_no_candidate() -> None:
    # mm(x, y): nothing to report (attention's q @ k, a plain matrix product)
    g = GraphBuilder()
    x, y = g.input("x", (4, 8)), g.parameter("y", (8, 6))
    g.output(g.call("aten.mm.default", name="mm", self=x, mat2=y, out=(4, 6)))
    report = plan(g.build(), [addmm_to_linear])
    assert not report.plans and not report.rejections


def test_the_rule_and_this_test_import_no_torch() -> None:
    code = "import sys, tests.core.test_addmm_to_linear_core; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
