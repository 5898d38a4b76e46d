"""Test models: ResNet / MobileNet / decoder style blocks with batch norms in every spot."""

from __future__ import annotations

import math

import torch
from torch import nn


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every batch norm non-trivial statistics and affine parameters; eval mode."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.data.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return model.eval()


class ResBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn + identity."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        return out


class ResNetish(nn.Module):
    def __init__(self, c: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, stride=2, padding=1), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*(ResBlock(c) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(torch.relu(self.bn(self.stem(x))))
        return out


class MobileBlock(nn.Module):
    """Depthwise 3x3 + BN + ReLU6, pointwise 1x1 + BN (MobileNet v1/v2 style)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.dw, self.b1 = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin)
        self.pw, self.b2 = nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b2(self.pw(nn.functional.relu6(self.b1(self.dw(x)))))
        return out


class MobileNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(MobileBlock(3, 8, 2), MobileBlock(8, 16), MobileBlock(16, 16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(x)
        return out


class Decoder(nn.Module):
    """Transposed convs, grouped and not, with and without bias, into BN (upstream crashes here)."""

    def __init__(self) -> None:
        super().__init__()
        self.t1, self.b1 = nn.ConvTranspose2d(8, 12, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(12)
        self.t2 = nn.ConvTranspose2d(12, 8, 3, stride=1, padding=1, groups=4, bias=False)
        self.b2 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b2(self.t2(torch.relu(self.b1(self.t1(x)))))
        return out


class Conv1dStack(nn.Module):
    """Audio-style conv1d stack with a non-affine BN and a dilated conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv1d(4, 8, 5, padding=2), nn.BatchNorm1d(8, affine=False)
        self.c2, self.b2 = nn.Conv1d(8, 8, 3, dilation=2, groups=2, bias=False), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return out


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.b = nn.Conv3d(2, 6, 3, stride=(1, 2, 2), padding=1), nn.BatchNorm3d(6)
        self.t, self.bt = nn.ConvTranspose3d(6, 4, 2, stride=2, groups=2), nn.BatchNorm3d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bt(self.t(self.b(self.c(x))))
        return out


class Declines(nn.Module):
    """Every batch norm here must be declined, for a different reason each."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)  # conv output also used
        self.b2, self.lin = nn.BatchNorm1d(4), nn.Linear(4, 4)  # BN after a mean (no conv), then a linear
        self.c3, self.b3 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)  # fused normally

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.c1(x)
        z = self.b1(y) + y
        v = self.lin(self.b2(z.mean(dim=(2, 3))))
        out: torch.Tensor = self.b3(self.c3(z))
        return out, v


class SharedWeight(nn.Module):
    """One conv weight used twice: once into a BN (fused), once plain (must keep original numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.c(x)) + nn.functional.conv2d(x, self.c.weight, None, padding=1)
        return out


def example(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """A deterministic example input for each test model."""
    g = torch.Generator().manual_seed(1)
    shapes: dict[type, tuple[int, ...]] = {
        Decoder: (2, 8, 5, 5),
        Conv1dStack: (2, 4, 32),
        Conv3dNet: (1, 2, 4, 8, 8),
        Declines: (2, 3, 6, 6),
        SharedWeight: (1, 4, 6, 6),
    }
    return (torch.randn(shapes.get(type(model), (2, 3, 16, 16)), generator=g),)


ALL_MODELS: dict[str, type[nn.Module]] = {
    "resnet": ResNetish,
    "mobilenet": MobileNetish,
    "decoder": Decoder,
    "conv1d": Conv1dStack,
    "conv3d": Conv3dNet,
    "declines": Declines,
    "shared": SharedWeight,
}


class ResNeXtBlock(nn.Module):
    """1x1 -> grouped 3x3 (cardinality G) -> 1x1, each with BN, plus identity."""

    def __init__(self, c: int = 16, width: int = 16, groups: int = 4, stride: int = 1) -> None:
        super().__init__()
        self.a, self.ba = nn.Conv2d(c, width, 1, bias=False), nn.BatchNorm2d(width)
        self.b, self.bb = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(width)
        self.c, self.bc = nn.Conv2d(width, c, 1, bias=False), nn.BatchNorm2d(c)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bc(self.c(torch.relu(self.bb(self.b(torch.relu(self.ba(self.a(x))))))))
        out: torch.Tensor = torch.relu(y + x[:, :, :: self.stride, :: self.stride])
        return out


class ResNeXtish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ResNeXtBlock(groups=4), ResNeXtBlock(width=24, groups=8, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(x)
        return out


class ShuffleBlock(nn.Module):
    """ShuffleNet v1 unit: grouped 1x1 (with bias), channel shuffle, depthwise 3x3, grouped 1x1."""

    def __init__(self, c: int = 12, groups: int = 3) -> None:
        super().__init__()
        self.g = groups
        self.g1 = nn.Conv2d(c, c, 1, groups=groups)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.g2 = nn.Conv2d(c, c, 1, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.g1(x))
        n, c, h, w = y.shape
        y = y.reshape(n, self.g, c // self.g, h, w).transpose(1, 2).reshape(n, c, h, w)
        out: torch.Tensor = torch.relu(x + self.g2(self.dw(y)))
        return out


class AudioStack(nn.Module):
    """conv1d stack with groups 2..10, strides, padding and dilation, bias and not."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        gs = list(range(2, 11))
        c = 4
        for i, g in enumerate(gs):
            out = math.lcm(g, gs[i + 1]) if i + 1 < len(gs) else 2 * g
            layers += [
                nn.Conv1d(c, out, 3, stride=1 + i % 2, padding=i % 3, dilation=1 + i % 2, groups=g, bias=i % 2 == 0),
                nn.ReLU(),
            ]
            c = out
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class OutOfPolicy(nn.Module):
    """A grouped conv with 12 groups (declined by the default policy) and a depthwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Conv2d(24, 24, 3, padding=1, groups=12)
        self.dw = nn.Conv2d(24, 24, 3, padding=1, groups=24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dw(self.wide(x))
        return out


SPLIT_MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "resnext": (ResNeXtish, (2, 16, 12, 12)),
    "shufflenet": (ShuffleBlock, (2, 12, 8, 8)),
    "audio": (AudioStack, (2, 4, 400)),
    "out_of_policy": (OutOfPolicy, (1, 24, 6, 6)),
}


class QMobile(nn.Module):
    """MobileNet-style for int8: 3x3 stem, depthwise + pointwise pairs, widths that need padding."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dw1, self.pw1 = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 16, 1)
        self.dw2, self.pw2 = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16, bias=False), nn.Conv2d(16, 6, 1)
        self.head = nn.Conv2d(6, 8, 3, padding=1)  # im2col width 54 -> 56

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = torch.relu(self.pw1(torch.relu(self.dw1(y))))
        y = self.pw2(torch.relu(self.dw2(y)))
        out: torch.Tensor = self.head(y)
        return out


class QResNet(nn.Module):
    """ResNet-style for int8: 3x3 convs with BN (folded by PT2E), strided, residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ResNetish(c=8, blocks=2)
        self.down = nn.Conv2d(8, 12, 3, stride=2, padding=1, dilation=1)
        self.wide = nn.Conv2d(12, 12, 3, padding=2, dilation=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wide(torch.relu(self.down(self.net(x))))
        return out


class QGrouped(nn.Module):
    """Grouped convs: 3x3 with 8 channels per group (packed), 1x1 grouped (upstream's pw kernel would
    ignore its groups), and 2 channels per group (a group would cross a texel: declined)."""

    def __init__(self) -> None:
        super().__init__()
        self.g3 = nn.Conv2d(8, 16, 3, padding=1, groups=2)
        self.g1 = nn.Conv2d(16, 16, 1, groups=2)
        self.narrow = nn.Conv2d(16, 16, 3, padding=1, groups=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.narrow(torch.relu(self.g1(torch.relu(self.g3(x)))))
        return out


class QTransposed(nn.Module):
    """Transposed convs (a decoder): stride 2, output padding, with and without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.t1 = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.t2 = nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1, bias=False)
        self.c = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c(torch.relu(self.t2(torch.relu(self.t1(x)))))
        return out


class QOddDepthwise(nn.Module):
    """A depthwise conv with 6 channels (upstream asserts) between two regular convs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.dw, self.b = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.Conv2d(6, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.dw(torch.relu(self.a(x)))))
        return out


class QTwin(nn.Module):
    """Two 8->8 3x3 convs; tests make them share one int8 weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        return out


Q_MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "mobilenet": (QMobile, (1, 3, 16, 16)),
    "resnet": (QResNet, (1, 3, 16, 16)),
    "grouped": (QGrouped, (1, 8, 8, 8)),
    "transposed": (QTransposed, (1, 8, 5, 5)),
    "odd_depthwise": (QOddDepthwise, (1, 3, 8, 8)),
    "twin": (QTwin, (1, 8, 8, 8)),
}


class ScaledConv(nn.Module):
    """``conv(x * scale)``: a scale before a conv, per channel or broadcasting ``x``."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.scale: torch.Tensor
        self.register_buffer("scale", scale)
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x * self.scale)
        return out
