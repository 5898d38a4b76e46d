"""No silent wrong answer: name collisions with existing keys, folds that overflow their dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import adapters
from fxpure.rules import fuse_conv_bn
from tests.models import randomize_bn
from tests.programs import FORMS, assert_sound, build, run


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))


class TakenName(nn.Module):
    """A model that already owns, under the names fxpure gives the fused weight and bias in each
    form, a parameter (aten, edge) or a submodule (whose attribute a GraphModule would lose)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.conv2d_bn_weight = nn.Parameter(torch.randn(4))
        self.conv2d_bn_bias = Holder()
        self.aten_convolution_default_bn_weight = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taken = self.conv2d_bn_weight + self.conv2d_bn_bias.w + self.aten_convolution_default_bn_weight
        out: torch.Tensor = self.bn(self.conv(x)) * taken.reshape(1, 4, 1, 1)
        return out


@pytest.mark.parametrize("form", FORMS)
def test_new_constants_never_take_an_existing_key(form: str) -> None:
    model, x = TakenName(), (torch.randn(1, 3, 8, 8),)
    randomize_bn(model)
    with torch.no_grad():
        want = [model(*x)]
    program = build(model, x, form)
    outcome = adapters.transform(program, [fuse_conv_bn()]).unwrap()
    assert len(outcome.report.plans) == 1
    assert_sound(program, x, want)
    if isinstance(program, torch.export.ExportedProgram):
        targets = [s.target for s in program.graph_signature.input_specs if s.target is not None]
        assert len(targets) == len(set(targets))
        assert torch.equal(program.state_dict["conv2d_bn_weight"], model.conv2d_bn_weight)


class Overflow(nn.Module):
    """Two conv+BN pairs; the first BN's scale (gamma / sqrt(var + eps) = 6e6) fits in the activations
    but not, multiplied into the weight, in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)
        assert self.c1.bias is not None and self.b1.running_var is not None
        with torch.no_grad():
            self.c1.weight.fill_(1.0)
            self.c1.bias.zero_()
            self.b1.weight.fill_(6e4)
            self.b1.bias.zero_()
            self.b1.running_var.fill_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b2(self.c2(self.b1(self.c1(x))))
        return out


@pytest.mark.parametrize("form", FORMS)
def test_fold_that_overflows_is_declined_and_the_rest_applies(form: str) -> None:
    model = Overflow().eval().half()
    x = ((torch.randn(1, 3, 8, 8) * 1e-5).half(),)
    with torch.no_grad():
        want = [model(*x)]
    assert torch.isfinite(want[0]).all()
    program = build(model, x, form)
    outcome = adapters.transform(program, [fuse_conv_bn()]).unwrap()
    (declined,) = outcome.report.rejections
    assert declined.reason.code == "non-finite-weight" and "float16" in declined.reason.message
    assert len(outcome.report.plans) == 1 and outcome.report.plans[0].anchor != declined.node
    got = run(program, x)
    assert torch.isfinite(got[0]).all()
    assert torch.equal(got[0], want[0]) or (got[0].float() - want[0].float()).abs().max() <= 1e-2 * want[0].abs().max()
