"""The programs the benchmarks rewrite: ``n`` repeated blocks, each with one candidate of its rule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge
from torch import nn


class Repeat(nn.Module):
    """``n`` blocks in a row."""

    def __init__(self, n: int, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*(block() for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def conv_bn(c: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())


def grouped(c: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=4), nn.ReLU())


def linear_bn(c: int) -> nn.Module:
    return nn.Sequential(nn.Linear(c, c), nn.BatchNorm1d(c), nn.ReLU())


class ConvScale(nn.Module):
    """conv -> * a per-channel constant -> relu."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.register_buffer("scale", torch.rand(1, c, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) * self.scale)


class ConvMulScalar(nn.Module):
    """conv -> * 0.5 -> relu (the scalar is what Arm's FoldScalarMulIntoConvPass folds)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) * 0.5)


def conv1d(c: int) -> nn.Module:
    return nn.Sequential(nn.Conv1d(c, c, 3, padding=1), nn.ReLU())


def linear(c: int) -> nn.Module:
    return nn.Sequential(nn.Linear(c, c), nn.ReLU())


class QKV(nn.Module):
    """Three projections of one input (different widths), summed back to ``c`` features."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.v(x)
        out: torch.Tensor = self.q(x) * self.k(x) + torch.cat([v, v], dim=-1)
        return out


class Block(nn.Module):
    """A transformer block: attention (separate Q, K, V projections), MLP, two layer norms."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        a = torch.softmax(split(self.q(h)) @ split(self.k(h)).transpose(-1, -2) * (d // self.heads) ** -0.5, -1)
        x = x + self.o((a @ split(self.v(h))).transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.ln2(x))))
        return out


def export(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model.eval(), (x,))


def edge(model: nn.Module, x: torch.Tensor, *, keep_linear: bool = False) -> EdgeProgramManager:
    config = EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default]) if keep_linear else None
    return to_edge(export(model, x), compile_config=config)
