"""A program of a dynamic batch, rewritten, lowered to ExecuTorch: the .pte takes every batch the
program declares. torch's fake conv picks a kernel by the batch size (``size(0) >= 16``) and
guards it the first time a pass traces a conv: ``to_edge`` and ``to_executorch`` trace every node
again, and the new convs of fuse-conv-bn, split-group-conv, conv1d-to-conv2d and linear-to-conv2d
capped the batch at 15 (the .pte refused a batch of 16)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from executorch.exir import to_edge
from torch import nn
from torch.export import Dim

import adapters
from fxpure.plan import Rule
from fxpure.rules import conv1d_to_conv2d, fuse_conv_bn, linear_to_conv2d, split_group_conv
from tests.models import randomize_bn
from tests.programs import assert_close, run_pte


class ConvBN(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, groups=groups), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.conv(torch.relu(x)))
        return out


class Conv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(torch.relu(x))
        return out


class Mlp(nn.Module):  # a transformer's: layer norm, then a linear on (N, T, C)
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.norm(x))
        return out


class Stem(nn.Module):  # two conv-BN-ReLUs in a row: the second new conv reads an old node
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], Callable[[], Rule]]] = {
    "fuse-conv-bn": (lambda: randomize_bn(ConvBN()), (8, 10, 10), fuse_conv_bn),
    # an exported activation's value records no grad, which the lowering's does: the second conv
    # was run ahead on an input of another key in torch's cache (aten: the batch capped at 15)
    "fuse-conv-bn, two in a row": (lambda: randomize_bn(Stem()), (8, 10, 10), fuse_conv_bn),
    "split-group-conv": (lambda: ConvBN(groups=2).eval(), (8, 10, 10), split_group_conv),
    "conv1d-to-conv2d": (lambda: Conv1d().eval(), (8, 10), conv1d_to_conv2d),
    "linear-to-conv2d": (lambda: Mlp().eval(), (10, 8), linear_to_conv2d),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rewritten_edge_program_lowers_for_every_batch_it_declares(name: str) -> None:
    make, sizes, rule = CASES[name]
    model = make()
    batch = ({0: Dim("batch", min=1, max=64)},)
    edge = to_edge(torch.export.export(model, (torch.randn(2, *sizes),), dynamic_shapes=batch))
    assert adapters.transform(edge.exported_program(), [rule()]).unwrap().report.plans
    pte = edge.to_executorch().buffer
    for n in (3, 16, 64):
        x = (torch.randn(n, *sizes),)
        with torch.no_grad():
            assert_close(run_pte(pte, x), [model(*x)], rel=1e-4)


# (linear-to-conv2d: the new conv reads a view of a layer norm, a value requiring grad in the lowering)
@pytest.mark.parametrize(
    "name", ["fuse-conv-bn", "fuse-conv-bn, two in a row", "split-group-conv", "conv1d-to-conv2d", "linear-to-conv2d"]
)
def test_a_rewritten_aten_program_lowers_for_every_batch_it_declares(name: str) -> None:
    make, sizes, rule = CASES[name]
    model = make()
    ep = torch.export.export(model, (torch.randn(2, *sizes),), dynamic_shapes=({0: Dim("batch", min=1, max=64)},))
    assert adapters.transform(ep, [rule()]).unwrap().report.plans
    pte = to_edge(ep).to_executorch().buffer
    x = (torch.randn(16, *sizes),)
    with torch.no_grad():
        assert_close(run_pte(pte, x), [model(*x)], rel=1e-4)
