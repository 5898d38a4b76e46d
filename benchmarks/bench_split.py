"""fxpure split_group_conv vs upstream NXP SplitGroupConvolution on identical GraphModules.

Prints µs per grouped conv for each, the speed-up, and the FX floor: what torch.fx itself spends on
the result (code generation for the final graph, creating the new nodes), which bounds the speed-up
any implementation can reach ("ceiling" = upstream / floor). Run: python -m benchmarks.bench_split
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from adapters.passes import SplitGroupConvolutionPass

warnings.filterwarnings("ignore")


def upstream_pass() -> Callable[[], Any]:
    """NXP's pass class. Its import chain may reach the proprietary eIQ Neutron SDK, which is
    not installable here: only in this benchmark, an empty stand-in module satisfies it."""
    try:
        from executorch.backends.nxp.aten_passes.split_group_convolution import (  # type: ignore[import-untyped]
            SplitGroupConvolution,
        )
    except ImportError:
        sys.modules.setdefault("eiq_neutron_sdk", types.ModuleType("eiq_neutron_sdk"))
        from executorch.backends.nxp.aten_passes.split_group_convolution import (
            SplitGroupConvolution,
        )
    cls: Callable[[], Any] = SplitGroupConvolution
    return cls


class GroupedChain(nn.Module):
    """``convs`` x (grouped conv3x3, groups=4 -> ReLU)."""

    def __init__(self, convs: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(convs):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, groups=4), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def graph_module(convs: int, channels: int) -> torch.fx.GraphModule:
    model = GroupedChain(convs, channels).eval()
    return torch.export.export(model, (torch.randn(1, channels, 8, 8),)).module()


def _time(original: torch.fx.GraphModule, make: Callable[[], Any]) -> float:
    """Seconds until a fresh copy is transformed and runnable again.

    Upstream edits the graph and leaves ``recompile()`` to its caller; fxpure's pass
    recompiles itself. Both timings include it, so both end with a usable GraphModule.
    """
    gm = copy.deepcopy(original)
    p = make()
    t0 = time.perf_counter()
    p(gm)
    if make is not SplitGroupConvolutionPass:
        gm.recompile()
    return time.perf_counter() - t0


def fx_floor(original: torch.fx.GraphModule) -> float:
    """Seconds torch.fx alone needs for the split result, whoever plans it: regenerating the code of
    the final graph (``recompile``) plus creating its new nodes. Nothing can be faster than this."""
    gm = copy.deepcopy(original)
    SplitGroupConvolutionPass()(gm)
    t0 = time.perf_counter()
    gm.recompile()
    recompile = time.perf_counter() - t0
    old = {n.name for n in original.graph.nodes}
    fresh = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    t0 = time.perf_counter()
    for n in gm.graph.nodes:
        env[n] = fresh.node_copy(n, env.__getitem__)
    create = time.perf_counter() - t0
    new = sum(1 for n in gm.graph.nodes if n.name not in old)
    return recompile + create * new / len(gm.graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--convs", type=int, nargs="*", default=[50, 200])
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    upstream = upstream_pass()
    warm = graph_module(2, 8)
    _time(warm, SplitGroupConvolutionPass)
    _time(warm, upstream)
    print(
        f"{'convs':>6} {'fxpure µs/conv':>15} {'upstream µs/conv':>17} {'speed-up':>9} "
        f"{'FX floor µs/conv':>17} {'ceiling':>8}"
    )
    rows = []
    for n in args.convs:
        original = graph_module(n, args.channels)
        x = torch.randn(1, args.channels, 8, 8)
        ours = min(_time(original, SplitGroupConvolutionPass) for _ in range(args.repeats))
        theirs = min(_time(original, upstream) for _ in range(args.repeats))
        floor = min(fx_floor(original) for _ in range(args.repeats))
        check = copy.deepcopy(original)
        SplitGroupConvolutionPass()(check)
        err = (check(x) - original(x)).abs().max().item()
        rows.append((n, 1e6 * ours / n, 1e6 * theirs / n))
        print(
            f"{n:>6} {1e6 * ours / n:>15.1f} {1e6 * theirs / n:>17.1f} {theirs / ours:>8.1f}x "
            f"{1e6 * floor / n:>17.1f} {theirs / floor:>7.1f}x  (max abs diff {err:.1e})"
        )
    if len(rows) > 1:
        print(
            f"fxpure µs/conv growth {rows[0][0]} -> {rows[-1][0]} convs: {rows[-1][1] / rows[0][1]:.2f}x; "
            f"upstream: {rows[-1][2] / rows[0][2]:.2f}x"
        )


if __name__ == "__main__":
    main()
