"""hypothesis: random conv + BN, grouped conv and quantized conv configurations through the commuting
square and numerics."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adapters
import fxpure
from fxpure.rules import fuse_conv_bn, quantized_conv, split_group_conv
from fxpure.snapshot import GraphSnapshot
from tests.models import randomize_bn
from tests.programs import assert_close, build, count, run
from tests.quantized import assert_exact, quantize

CONV = {
    (1, False): torch.nn.Conv1d,
    (2, False): torch.nn.Conv2d,
    (3, False): torch.nn.Conv3d,
    (1, True): torch.nn.ConvTranspose1d,
    (2, True): torch.nn.ConvTranspose2d,
    (3, True): torch.nn.ConvTranspose3d,
}
BN = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}


@dataclass(frozen=True)
class Config:
    rank: int
    transposed: bool
    groups: int
    cin: int
    cout: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    bias: bool
    affine: bool
    dtype: torch.dtype
    form: str


@st.composite
def configs(draw: st.DrawFn) -> Config:
    rank = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2, 3]))
    return Config(
        rank=rank,
        transposed=draw(st.booleans()),
        groups=groups,
        cin=groups * draw(st.integers(1, 3)),
        cout=groups * draw(st.integers(1, 3)),
        kernel=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        dilation=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        affine=draw(st.booleans()),
        dtype=draw(
            st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16])
            if rank < 3
            else st.just(torch.float32)
        ),
        form=draw(st.sampled_from(["gm", "aten", "edge"])),
    )


def model_for(c: Config) -> torch.nn.Module:
    conv = CONV[(c.rank, c.transposed)](
        c.cin, c.cout, c.kernel, stride=c.stride, padding=c.padding, dilation=c.dilation, groups=c.groups, bias=c.bias
    )
    return randomize_bn(torch.nn.Sequential(conv, BN[c.rank](c.cout, affine=c.affine))).to(c.dtype)


def normal(s: GraphSnapshot) -> tuple[Any, ...]:
    """A snapshot without what differs only by materialisation (storage, expression, provenance)."""
    nodes = tuple((n.name, n.op, n.target, n.args, dict(n.kwargs), n.spec) for n in s.nodes)
    consts = {k: (v.kind, v.key, v.spec) for k, v in s.constants.items()}
    return nodes, consts, s.dialect, s.lifted


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_commuting_square_and_numerics(c: Config) -> None:
    model = model_for(c)
    x = (torch.randn(2, c.cin, *(6,) * c.rank).to(c.dtype),)
    want = run(build(model, x, "aten"), x)
    program = build(model, x, c.form)
    g = adapters.capture(program)
    report = fxpure.plan(g, [fuse_conv_bn()])
    assert len(report.plans) == 1, report.rejections
    adapters.apply(program, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    assert count(program, "batch_norm") == 0
    assert_close(run(program, x), want, rel=1e-5 if c.dtype == torch.float32 else 5e-2)


@dataclass(frozen=True)
class GroupedConfig:
    rank: int
    groups: int
    cin_per_group: int
    cout_per_group: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    bias: bool
    form: str


@st.composite
def grouped_configs(draw: st.DrawFn) -> GroupedConfig:
    return GroupedConfig(
        rank=draw(st.integers(1, 2)),
        groups=draw(st.integers(2, 10)),
        cin_per_group=draw(st.integers(1, 3)),
        cout_per_group=draw(st.integers(1, 3)),
        kernel=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 2)),
        dilation=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        form=draw(st.sampled_from(["gm", "aten"])),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_configs())
def test_split_commuting_square_and_numerics(c: GroupedConfig) -> None:
    conv = CONV[(c.rank, False)](
        c.groups * c.cin_per_group,
        c.groups * c.cout_per_group,
        c.kernel,
        stride=c.stride,
        padding=c.padding,
        dilation=c.dilation,
        groups=c.groups,
        bias=c.bias,
    )
    x = (torch.randn(2, c.groups * c.cin_per_group, *(7,) * c.rank),)
    want = run(build(conv, x, "aten"), x)
    program = build(conv, x, c.form)
    g = adapters.capture(program)
    report = fxpure.plan(g, [split_group_conv()])
    depthwise = c.cin_per_group == c.cout_per_group == 1
    assert len(report.plans) == (0 if depthwise else 1), report.rejections
    adapters.apply(program, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    assert_close(run(program, x), want)


@dataclass(frozen=True)
class QuantConfig:
    kind: str
    groups: int
    cin: int
    cout: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    bias: bool
    relu: bool
    per_channel: bool


@st.composite
def quant_configs(draw: st.DrawFn) -> QuantConfig:
    kind = draw(st.sampled_from(["regular", "grouped", "depthwise", "transposed"]))
    groups = {"grouped": 2, "depthwise": 4 * draw(st.integers(1, 3))}.get(kind, 1)
    cin = groups if kind == "depthwise" else groups * draw(st.integers(2, 6))  # 1 -> 1 would be depthwise
    cout = (
        groups
        if kind == "depthwise"
        else 4 * groups * draw(st.integers(1, 2))
        if kind == "grouped"
        else draw(st.integers(1, 10))
    )
    return QuantConfig(
        kind=kind,
        groups=groups,
        cin=cin,
        cout=cout,
        kernel=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        dilation=1 if kind == "transposed" else draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        relu=draw(st.booleans()),
        per_channel=draw(st.booleans()),
    )


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_configs())
def test_quantized_conv_commuting_square_and_exact_int8(c: QuantConfig) -> None:
    cls = torch.nn.ConvTranspose2d if c.kind == "transposed" else torch.nn.Conv2d
    conv = cls(
        c.cin, c.cout, c.kernel, stride=c.stride, padding=c.padding, dilation=c.dilation, groups=c.groups, bias=c.bias
    )
    model = torch.nn.Sequential(conv, torch.nn.ReLU()) if c.relu else conv
    x = (torch.randn(1, c.cin, 7, 7),)
    ep = quantize(model, x, per_channel=c.per_channel).exported_program()
    original = copy.deepcopy(ep)
    g = adapters.capture(ep)
    report = fxpure.plan(g, [quantized_conv()])
    assert len(report.plans) == 1, report.rejections
    adapters.apply(ep, report.plans).unwrap()
    assert normal(adapters.capture(ep)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    assert_exact(ep, original, report, x)
