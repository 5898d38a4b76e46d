"""fxpure quantized_conv vs upstream's Vulkan detector + replacement on identical quantized edge programs.

Prints ms per conv layer for each, the speed-up, and the bytes of constants each leaves in the
program. Run: python -m benchmarks.bench_qconv
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
from executorch.exir import EdgeProgramManager
from torch import nn
from torch.export import ExportedProgram

from adapters.passes import QuantizedConvolutionPass
from benchmarks.timing import time_pass
from tests.quantized import quantize, upstream_pack

warnings.filterwarnings("ignore")


class Stack(nn.Module):
    """``layers`` convs cycling 3x3 (im2col), depthwise 3x3 and pointwise 1x1, each with ReLU."""

    def __init__(self, layers: int, channels: int) -> None:
        super().__init__()
        kinds = [
            lambda: nn.Conv2d(channels, channels, 3, padding=1),
            lambda: nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
            lambda: nn.Conv2d(channels, channels, 1),
        ]
        body: list[nn.Module] = []
        for i in range(layers):
            body += [kinds[i % 3](), nn.ReLU()]
        self.body = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def program(layers: int, channels: int) -> EdgeProgramManager:
    return quantize(Stack(layers, channels), (torch.randn(1, channels, 8, 8),))


def upstream(ep: ExportedProgram) -> Callable[[torch.fx.GraphModule], object]:
    """Upstream's detector + replacement loop over ``ep``, as a pass on its graph module."""
    return lambda _: upstream_pack(ep)


def constant_bytes(ep: ExportedProgram) -> int:
    stored = [*ep.state_dict.values(), *ep.constants.values()]
    return sum(t.numel() * t.element_size() for t in stored if isinstance(t, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of N, the two interleaved")
    args = parser.parse_args()
    warm = program(3, 8)  # first-call costs (imports, dispatch caches) off the clock, for both
    time_pass(warm, QuantizedConvolutionPass)
    time_pass(warm, upstream)
    print(
        f"{'layers':>6} {'fxpure ms/conv':>15} {'upstream ms/conv':>17} {'speed-up':>9} "
        f"{'(upstream GC off)':>18} {'fxpure const B':>15} {'upstream const B':>17}"
    )
    rows = []
    for layers in args.layers:
        original = program(layers, args.channels)
        # interleaved, so both see the same phases of this shared machine's load
        runs = [
            (time_pass(original, QuantizedConvolutionPass), time_pass(original, upstream)) for _ in range(args.repeats)
        ]
        t_ours, ep_ours = min((r[0] for r in runs), key=lambda r: r[0])
        t_up, ep_up = min((r[1] for r in runs), key=lambda r: r[0])
        t_up_nogc = min(time_pass(original, upstream, gc_off=True)[0] for _ in range(args.repeats))
        rows.append((layers, t_ours, t_up))
        print(
            f"{layers:>6} {1e3 * t_ours / layers:>15.3f} {1e3 * t_up / layers:>17.3f} {t_up / t_ours:>8.1f}x "
            f"{t_up_nogc / t_ours:>17.1f}x {constant_bytes(ep_ours):>15} {constant_bytes(ep_up):>17}",
            flush=True,
        )
    if len(rows) > 1:
        (n0, o0, u0), (n1, o1, u1) = rows[0], rows[-1]
        print(
            f"per-conv cost growth {n0} -> {n1} layers: fxpure {(o1 / n1) / (o0 / n0):.2f}x, "
            f"upstream {(u1 / n1) / (u0 / n0):.2f}x"
        )


if __name__ == "__main__":
    main()
