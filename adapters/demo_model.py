"""The embedded CNN of ``fxpure demo``: fusable blocks plus BNs that must be declined."""

from __future__ import annotations

import torch
from torch import nn


class DemoNet(nn.Module):
    """ResNet-style stem and block, a depthwise/pointwise pair, a grouped conv, a transposed-conv decoder,
    a BN whose conv output is reused (declined) and a BN after a linear layer (declined)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw, self.dw_bn = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw, self.pw_bn = nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.grp, self.grp_bn = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(2 * c)
        self.up, self.up_bn = nn.ConvTranspose2d(2 * c, c, 2, stride=2, groups=2), nn.BatchNorm2d(c)
        self.tap, self.tap_bn = nn.Conv2d(c, c, 1), nn.BatchNorm2d(c)
        self.head, self.head_bn = nn.Linear(c, 10), nn.BatchNorm1d(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem_bn(self.stem(x)))
        y = torch.relu(y + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(y))))))
        y = self.pw_bn(self.pw(torch.relu(self.dw_bn(self.dw(y)))))
        y = torch.relu(self.grp_bn(self.grp(y)))  # grouped: fused, then split for NPUs
        y = torch.relu(self.up_bn(self.up(y)))
        t = self.tap(y)
        y = self.tap_bn(t) + t  # conv output used twice: cannot fuse
        out: torch.Tensor = self.head_bn(self.head(y.mean(dim=(2, 3))))
        return out


def demo_model(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The demo model in eval mode with non-trivial BN statistics, and an example input."""
    torch.manual_seed(seed)
    model = DemoNet()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval(), (torch.randn(2, 3, 32, 32),)
