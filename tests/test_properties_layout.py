"""hypothesis: random conv1d / conv_transpose1d and linear configurations through conv1d_to_conv2d and
linear_to_conv2d: the commuting square ``capture(apply(g, p)) == rewrite(capture(g), p)`` and numerics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from executorch.exir import EdgeCompileConfig, to_edge
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import adapters
import fxpure
from fxpure.rules.conv1d_to_conv2d import conv1d_to_conv2d
from fxpure.rules.linear_to_conv2d import linear_to_conv2d
from tests.programs import assert_close, build, run
from tests.test_properties import normal


@dataclass(frozen=True)
class Conv1dConfig:
    transposed: bool
    groups: int
    cin: int
    cout: int
    kernel: int
    stride: int
    padding: int | str
    dilation: int
    output_padding: int
    bias: bool
    form: str


@st.composite
def conv1d_configs(draw: st.DrawFn) -> Conv1dConfig:
    transposed, groups = draw(st.booleans()), draw(st.sampled_from([1, 2]))
    stride, dilation = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    strings: list[int | str] = [] if transposed else ["valid"] if stride > 1 else ["valid", "same"]
    return Conv1dConfig(
        transposed=transposed,
        groups=groups,
        cin=groups * draw(st.integers(1, 3)),
        cout=groups * draw(st.integers(1, 3)),
        kernel=draw(st.integers(1, 4)),
        stride=stride,
        padding=draw(st.sampled_from([0, 1, 2, *strings])),  # a string: conv1d.padding -> conv2d.padding
        dilation=dilation,
        output_padding=draw(st.integers(0, max(stride, dilation) - 1)) if transposed else 0,
        bias=draw(st.booleans()),
        form=draw(st.sampled_from(["gm", "aten", "edge"])),
    )


def conv1d_for(c: Conv1dConfig) -> nn.Module:
    if c.transposed:
        return nn.ConvTranspose1d(
            c.cin,
            c.cout,
            c.kernel,
            stride=c.stride,
            padding=int(c.padding),
            output_padding=c.output_padding,
            groups=c.groups,
            bias=c.bias,
            dilation=c.dilation,
        )
    return nn.Conv1d(
        c.cin, c.cout, c.kernel, stride=c.stride, padding=c.padding, dilation=c.dilation, groups=c.groups, bias=c.bias
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv1d_configs())
def test_conv1d_commuting_square_and_numerics(c: Conv1dConfig) -> None:
    model = conv1d_for(c).eval()
    x = (torch.randn(2, c.cin, 9),)
    want = run(build(model, x, "aten"), x)
    program = build(model, x, c.form)
    g = adapters.capture(program)
    report = fxpure.plan(g, [conv1d_to_conv2d()])
    assert len(report.plans) == 1, report.rejections
    adapters.apply(program, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    assert_close(run(program, x), want)


@dataclass(frozen=True)
class LinearConfig:
    lead: tuple[int, ...]
    features: int
    out: int
    bias: bool
    form: str


@st.composite
def linear_configs(draw: st.DrawFn) -> LinearConfig:
    return LinearConfig(
        lead=tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))),
        features=draw(st.integers(1, 8)),
        out=draw(st.integers(1, 8)),
        bias=draw(st.booleans()),
        form=draw(st.sampled_from(["gm", "aten", "edge", "edge-linear"])),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(linear_configs())
def test_linear_commuting_square_and_numerics(c: LinearConfig) -> None:
    model = nn.Linear(c.features, c.out, bias=c.bias).eval()
    x = (torch.randn(*c.lead, c.features),)
    want = run(build(model, x, "aten"), x)
    keep = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default])
    edge = c.form == "edge-linear"
    program = (
        to_edge(torch.export.export(model, x), compile_config=keep).exported_program()
        if edge
        else build(model, x, c.form)
    )
    g = adapters.capture(program)
    report = fxpure.plan(g, [linear_to_conv2d()])
    assert len(report.plans) == 1, report.rejections
    adapters.apply(program, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    assert_close(run(program, x), want)
