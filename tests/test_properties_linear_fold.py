"""hypothesis: random linear + batch-norm and conv/linear + binary-op configurations through the
commuting square ``capture(apply(g, p)) == rewrite(capture(g), p)`` and numerics, in every program
form (unlifted GraphModule, aten program, edge program plain and with ``linear`` preserved)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from executorch.exir import EdgeCompileConfig, to_edge
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import adapters
import fxpure
from fxpure.plan import Rule
from fxpure.rules.fold_binary import fold_binary
from fxpure.rules.fuse_linear_bn import fuse_linear_bn
from fxpure.snapshot import GraphSnapshot
from tests.models import randomize_bn
from tests.programs import Program, assert_close, run

FORMS = ("gm", "aten", "edge", "edge-linear")
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MORE = settings(SETTINGS, max_examples=20)


def build(model: nn.Module, x: tuple[torch.Tensor, ...], form: str) -> Program:
    ep = torch.export.export(copy.deepcopy(model), x)
    if form == "gm":
        return ep.module()
    if form == "aten":
        return ep
    preserve = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default])
    return (to_edge(ep, compile_config=preserve) if form == "edge-linear" else to_edge(ep)).exported_program()


def normal(s: GraphSnapshot) -> tuple[Any, ...]:
    """A snapshot without what differs only by materialisation (storage, expression, provenance)."""
    nodes = tuple((n.name, n.op, n.target, n.args, dict(n.kwargs), n.spec) for n in s.nodes)
    consts = {k: (v.kind, v.key, v.spec) for k, v in s.constants.items()}
    return nodes, consts, s.dialect, s.lifted


def square(model: nn.Module, x: tuple[torch.Tensor, ...], form: str, rule: Rule) -> GraphSnapshot:
    """Plan on the captured program, apply, and check the commuting square and the numerics; the
    rewritten snapshot."""
    want = [model(*x).detach()]
    program = build(model, x, form)
    g = adapters.capture(program)
    report = fxpure.plan(g, [rule])
    assert len(report.plans) == 1, report.rejections
    adapters.apply(program, report.plans).unwrap()
    after = fxpure.rewrite(g, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(after)
    assert_close(run(program, x), want)
    return after


class Product(nn.Module):
    """A linear written as a product, ``x @ W.T (+ b)``: an aten program keeps it as ``matmul`` of
    the weight's transpose, in the spelling the model wrote it."""

    T: ClassVar[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = {
        "x @ W.T": lambda w: w.T,
        "x @ W.t()": lambda w: w.t(),
        "x @ W.mT": lambda w: w.mT,
        "x @ W.transpose(0, 1)": lambda w: w.transpose(0, 1),
    }

    def __init__(self, spelling: str, cin: int, cout: int, bias: bool) -> None:
        super().__init__()
        self.spelling, self.weight = spelling, nn.Parameter(torch.randn(cout, cin) / cin**0.5)
        self.bias = nn.Parameter(torch.randn(cout)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.T[self.spelling](self.weight)
        return y if self.bias is None else y + self.bias


def linear_module(spelling: str, cin: int, cout: int, bias: bool) -> nn.Module:
    return nn.Linear(cin, cout, bias=bias) if spelling == "nn.Linear" else Product(spelling, cin, cout, bias)


SPELLINGS = ["nn.Linear", "nn.Linear", *Product.T]


# --- linear + batch norm ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearBN:
    rank: int
    swap: str  # how a rank-3 output reaches the BN with its features at dim 1
    cin: int
    cout: int
    bias: bool
    affine: bool
    batch: int
    seq: int
    form: str
    spelling: str = "nn.Linear"  # a Product without bias: with one, the bias add is between it and the BN


@st.composite
def linear_bns(draw: st.DrawFn) -> LinearBN:
    rank = draw(st.sampled_from([2, 3]))
    return LinearBN(
        rank=rank,
        swap=draw(st.sampled_from(["transpose(1, 2)", "transpose(-1, 1)", "permute(0, 2, 1)"])) if rank == 3 else "",
        cin=draw(st.integers(1, 6)),
        cout=draw(st.integers(1, 6)),
        bias=draw(st.booleans()),
        affine=draw(st.booleans()),
        batch=draw(st.integers(2, 4)),
        seq=draw(st.integers(1, 4)),
        form=draw(st.sampled_from(FORMS)),
        spelling=draw(st.sampled_from(SPELLINGS)),
    )


SWAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "": lambda y: y,
    "transpose(1, 2)": lambda y: y.transpose(1, 2),
    "transpose(-1, 1)": lambda y: y.transpose(-1, 1),
    "permute(0, 2, 1)": lambda y: y.permute(0, 2, 1),
}


class LinearThenBN(nn.Module):
    def __init__(self, c: LinearBN) -> None:
        super().__init__()
        self.lin, self.bn, self.swap = (
            linear_module(c.spelling, c.cin, c.cout, c.bias and c.spelling == "nn.Linear"),
            nn.BatchNorm1d(c.cout, affine=c.affine),
            c.swap,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(SWAPS[self.swap](self.lin(x)))
        return out


@SETTINGS
@given(linear_bns())
@example(LinearBN(rank=3, swap="transpose(1, 2)", cin=3, cout=5, bias=False, affine=True, batch=2, seq=3, form="edge"))
@example(
    LinearBN(
        rank=3,
        swap="permute(0, 2, 1)",
        cin=3,
        cout=4,
        bias=False,
        affine=True,
        batch=2,
        seq=3,
        form="aten",
        spelling="x @ W.T",
    )
)
def test_fuse_linear_bn_commuting_square_and_numerics(c: LinearBN) -> None:
    model = randomize_bn(LinearThenBN(c))
    x = (torch.randn(c.batch, *((c.seq,) if c.rank == 3 else ()), c.cin),)
    after = square(model, x, c.form, fuse_linear_bn())
    assert not any("batch_norm" in n.target for n in after.nodes)


# --- conv | linear + binary op ---------------------------------------------------------------------

CONVS = {
    (1, False): nn.Conv1d,
    (2, False): nn.Conv2d,
    (3, False): nn.Conv3d,
    (1, True): nn.ConvTranspose1d,
    (2, True): nn.ConvTranspose2d,
    (3, True): nn.ConvTranspose3d,
}
# y op c, as written in a model; the ones marked "tensor" need c to be a tensor (torch.add(c, y))
OPS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "y * c": lambda y, c: y * c,
    "c * y": lambda y, c: c * y,
    "y / c": lambda y, c: y / c,
    "y + c": lambda y, c: y + c,
    "c + y": lambda y, c: c + y,
    "y - c": lambda y, c: y - c,
    "c - y": lambda y, c: c - y,
    "add(y, c, alpha=2)": lambda y, c: torch.add(y, c, alpha=2),
    "sub(y, c, alpha=0.5)": lambda y, c: torch.sub(y, c, alpha=0.5),
    "rsub(y, c, alpha=3)": lambda y, c: torch.rsub(y, c, alpha=3),
    "add(c, y, alpha=3) tensor": lambda y, c: torch.add(c, y, alpha=3),
    "sub(c, y, alpha=-1) tensor": lambda y, c: torch.sub(c, y, alpha=-1),
}


@dataclass(frozen=True)
class Binary:
    producer: str  # "conv", "linear" or a Product spelling ("x @ W.T")
    rank: int  # spatial dims of a conv; dims of a linear's input
    transposed: bool
    groups: int
    cin: int
    cout: int
    kernel: int
    stride: int
    bias: bool
    op: str
    operand: str  # "number", "0-d", "channels" (C, 1, ...), "full" (1, C, 1, ...)
    value: float
    form: str


@st.composite
def binaries(draw: st.DrawFn) -> Binary:
    producer = draw(st.sampled_from(["conv", "conv", "linear", "linear", *Product.T]))
    groups = draw(st.sampled_from([1, 2, 3])) if producer == "conv" else 1
    op = draw(st.sampled_from(sorted(OPS)))
    operands = ["0-d", "channels", "full"] if op.endswith("tensor") else ["number", "0-d", "channels", "full"]
    operands += ["channels", "full"]  # per-channel constants are where layouts matter: twice as likely
    return Binary(
        producer=producer,
        rank=draw(st.integers(1, 3)) if producer == "conv" else draw(st.integers(2, 3)),
        transposed=draw(st.booleans()),
        groups=groups,
        cin=groups * draw(st.integers(1, 3)),
        cout=groups * draw(st.integers(1, 3)),
        kernel=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        op=op,
        operand=draw(st.sampled_from(operands)),
        value=draw(st.floats(0.5, 2.0)) * draw(st.sampled_from([1, -1])),
        form=draw(st.sampled_from(FORMS if producer != "conv" else FORMS[:3])),
    )


class ProducerThenOp(nn.Module):
    """The conv or linear, then the op with a number or a constant tensor ``c``."""

    def __init__(self, b: Binary) -> None:
        super().__init__()
        if b.producer == "conv":
            cls = CONVS[(b.rank, b.transposed)]
            self.y: nn.Module = cls(b.cin, b.cout, b.kernel, stride=b.stride, groups=b.groups, bias=b.bias)
            out_rank, channel = b.rank + 2, 1
        else:
            # (a Product's bias add would fold first: two plans, where the square checks one)
            linear = b.producer == "linear"
            self.y = linear_module("nn.Linear" if linear else b.producer, b.cin, b.cout, b.bias and linear)
            out_rank, channel = b.rank, b.rank - 1
        after = (1,) * (out_rank - channel - 1)
        shape = {"0-d": (), "channels": (b.cout, *after), "full": (*(1,) * channel, b.cout, *after)}.get(b.operand)
        self.op, self.number = b.op, b.value
        if shape is not None:
            per_channel = (torch.rand(b.cout, generator=torch.Generator().manual_seed(1)) + 0.5) * b.value
            self.register_buffer("c", per_channel.reshape(shape) if shape else torch.tensor(b.value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self._buffers.get("c")
        return OPS[self.op](self.y(x), c if c is not None else self.number)


@MORE
@given(binaries())
@example(  # a grouped transposed 3-D conv, y / c with a (1, C, 1, 1, 1) tensor (scales W per channel), in edge
    Binary("conv", 3, True, 2, 4, 6, 2, 2, True, "y / c", "full", -1.5, "edge")
)
@example(  # a view-wrapped rank-3 linear without bias (mm becomes addmm), c + 3 y, in edge
    Binary("linear", 3, False, 1, 4, 5, 1, 1, False, "add(c, y, alpha=3) tensor", "channels", 0.75, "edge")
)
def test_fold_binary_commuting_square_and_numerics(b: Binary) -> None:
    model = ProducerThenOp(b).eval()
    if b.producer == "conv":
        x = (torch.randn(2, b.cin, *(5,) * b.rank),)
    else:
        x = (torch.randn(2, *((3,) if b.rank == 3 else ()), b.cin),)
    after = square(model, x, b.form, fold_binary())
    assert all({"mul", "div", "add", "sub", "rsub"}.isdisjoint(n.target.split(".")[1:2]) for n in after.nodes)
