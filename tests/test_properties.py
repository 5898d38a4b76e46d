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


# how a drawn conv + batch norm is made one fuse_conv_bn declines, and the code it must give
DECLINES = {
    "training": "bn-training-mode",  # the batch norm in training mode (batch statistics)
    "shared": "conv-output-shared",  # the conv's output is returned too
    "relu": "producer-not-conv",  # a relu between them
    "computed": "not-constant",  # the conv's weight computed at run time (w * x.mean(); w * 2 is a constant)
}
F_CONV = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


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
    output_padding: int
    bias: bool
    affine: bool
    eps: float
    dtype: torch.dtype
    form: str
    decline: str | None


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """Any conv (rank 1..3, transposed or not, groups 1..4 or depthwise, up to 64 channels, stride,
    padding, dilation, output padding) then a batch norm (affine or not, any eps), in any program form;
    one draw in four made one the rule declines (:data:`DECLINES`)."""
    rank, transposed = draw(st.integers(1, 3)), draw(st.booleans())
    depthwise = draw(st.integers(0, 4)) == 0
    if depthwise:
        groups = cin = draw(st.integers(1, 64))
        cout = cin * draw(st.sampled_from([1, 1, 2]))
    else:
        groups = draw(st.sampled_from([1, 1, 2, 3, 4]))
        cin = groups * draw(st.integers(1, 64 // groups))
        cout = groups * draw(st.integers(1, 64 // groups))
    stride, dilation = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    decline = draw(st.sampled_from([None, None, None, *DECLINES]))
    if decline == "computed" and transposed:
        decline = None
    forms = ["gm", "aten"] if decline == "training" else ["gm", "aten", "edge"]
    return Config(
        rank=rank,
        transposed=transposed,
        groups=groups,
        cin=cin,
        cout=cout,
        kernel=draw(st.integers(1, 3)),
        stride=stride,
        padding=draw(st.integers(0, 2)),
        dilation=dilation,
        output_padding=draw(st.integers(0, max(stride, dilation) - 1)) if transposed else 0,
        bias=draw(st.booleans()),
        affine=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
        dtype=draw(
            st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16])
            if rank < 3
            else st.just(torch.float32)
        ),
        form=draw(st.sampled_from(forms)),
        decline=decline,
    )


class ConvBN(torch.nn.Module):
    """conv -> batch norm, or one of the :data:`DECLINES` variants of it."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        extra = {"output_padding": c.output_padding} if c.transposed else {}
        self.conv = CONV[(c.rank, c.transposed)](
            c.cin,
            c.cout,
            c.kernel,
            stride=c.stride,
            padding=c.padding,
            dilation=c.dilation,
            groups=c.groups,
            bias=c.bias,
            **extra,
        )
        self.bn = BN[c.rank](c.cout, affine=c.affine, eps=c.eps)

    def forward(self, x: torch.Tensor) -> Any:
        c, conv = self.c, self.conv
        if c.decline == "computed":
            y = F_CONV[c.rank](x, conv.weight * x.mean(), conv.bias, c.stride, c.padding, c.dilation, c.groups)
        else:
            y = conv(x)
        z = self.bn(torch.relu(y) if c.decline == "relu" else y)
        return (z, y) if c.decline == "shared" else z


def model_for(c: Config) -> torch.nn.Module:
    model = randomize_bn(ConvBN(c)).to(c.dtype)
    return model.train() if c.decline == "training" else model.eval()


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
    program = build(model, x, c.form)
    g = adapters.capture(program)
    if c.decline is not None:
        # declined with its typed code, and the program left as it was
        report = adapters.transform(program, [fuse_conv_bn()]).unwrap().report
        assert report.plans == ()
        assert [r.reason.code for r in report.rejections] == [DECLINES[c.decline]]
        assert normal(adapters.capture(program)) == normal(g)
        return
    want = run(build(model, x, "aten"), x)
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
    transposed: bool
    form: str


@st.composite
def grouped_configs(draw: st.DrawFn) -> GroupedConfig:
    """A grouped conv (rank 1 or 2, groups 2..12: beyond the policy's 10 too; depthwise; transposed) in
    any program form, edge too."""
    return GroupedConfig(
        rank=draw(st.integers(1, 2)),
        groups=draw(st.integers(2, 12)),
        cin_per_group=draw(st.integers(1, 3)),
        cout_per_group=draw(st.integers(1, 3)),
        kernel=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 2)),
        dilation=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        transposed=draw(st.integers(0, 5)) == 0,
        form=draw(st.sampled_from(["gm", "aten", "edge"])),
    )


def _split_declines(c: GroupedConfig) -> list[str]:
    """What split_group_conv (groups 2..10) must say about the conv: nothing, or one code."""
    if c.transposed:
        return ["transposed-conv"]
    if c.cin_per_group == c.cout_per_group == 1:
        return ["depthwise-conv"]
    return ["groups-out-of-range"] if c.groups > 10 else []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_configs())
def test_split_commuting_square_and_numerics(c: GroupedConfig) -> None:
    cin, cout = c.groups * c.cin_per_group, c.groups * c.cout_per_group
    conv = CONV[(c.rank, c.transposed)](
        cin,
        cout,
        c.kernel,
        stride=c.stride,
        padding=c.padding,
        dilation=c.dilation,
        groups=c.groups,
        bias=c.bias,
    )
    x = (torch.randn(2, cin, *(7,) * c.rank),)
    want = run(build(conv, x, "aten"), x)
    program = build(conv, x, c.form)
    g = adapters.capture(program)
    report = fxpure.plan(g, [split_group_conv()])
    declines = _split_declines(c)
    assert [r.reason.code for r in report.rejections] == declines
    assert len(report.plans) == (0 if declines else 1), report.rejections
    adapters.apply(program, report.plans).unwrap()
    assert normal(adapters.capture(program)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    if not declines:
        assert count(program, "slice") == c.groups and count(program, "cat") == 1
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
    fallback: str


ALIGN = 4  # quantized_conv's texel width


def misaligned(c: QuantConfig) -> bool:
    """No q8ta kernel takes the conv: depthwise channels not a multiple of the texel width; else, grouped,
    a group's output channels (a group must not cross a texel) or its input channels (upstream's
    ``Q8taConv2d.cpp``: ``VK_CHECK_COND(in_channels_per_group % 4 == 0)``) not a multiple of it."""
    icg, ocg = c.cin // c.groups, c.cout // c.groups
    # depthwise (transposed: its own kernel; one channel in and out, groups=1: the general kernels)
    if c.groups == c.cin == c.cout > 1 and c.kind != "transposed":
        return c.cout % ALIGN != 0
    return c.groups > 1 and (ocg % ALIGN != 0 or icg % ALIGN != 0)


@st.composite
def quant_configs(draw: st.DrawFn) -> QuantConfig:
    """A quantized conv: regular, grouped (2..4 groups), depthwise (with a channel multiplier too),
    transposed; output channels (per group) often not a multiple of 4, the kernels' texel width, so
    the rule declines (``fallback="none"``) or dequantizes the weight (the default)."""
    kind = draw(st.sampled_from(["regular", "grouped", "grouped", "depthwise", "depthwise", "transposed"]))
    if kind == "depthwise":
        groups = cin = draw(st.integers(2, 12))
        cout = cin * draw(st.sampled_from([1, 1, 2]))
    elif kind == "grouped":
        groups = draw(st.integers(2, 4))
        cin = groups * draw(st.integers(2, 4))  # 1 per group would be depthwise
        cout = groups * draw(st.sampled_from([4, 8, 1, 2, 3, 5, 6]))
    else:
        groups, cin, cout = 1, draw(st.integers(1, 12)), draw(st.integers(1, 10))
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
        fallback=draw(st.sampled_from(["dequantize", "none"])),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    report = fxpure.plan(g, [quantized_conv(fallback=c.fallback)])
    declined = misaligned(c)
    if declined and c.fallback == "none":
        assert report.plans == ()
        assert [r.reason.code for r in report.rejections] == ["channel-alignment"]
        adapters.apply(ep, report.plans).unwrap()
        assert normal(adapters.capture(ep)) == normal(g)
        return
    assert report.rejections == ()
    (p,) = report.plans
    assert (p.instead_of.code if p.instead_of is not None else None) == ("channel-alignment" if declined else None)
    adapters.apply(ep, report.plans).unwrap()
    assert normal(adapters.capture(ep)) == normal(fxpure.rewrite(g, report.plans).unwrap())
    if declined:
        # the weight dequantized once into a float constant: the conv computes what it computed
        assert count(ep, "q8ta") == 0 and count(ep, "dequantize_per_channel") == 0
        got, want = run(ep, x), run(original, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        assert_exact(ep, original, report, x)
