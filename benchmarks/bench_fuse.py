"""fxpure fuse_conv_bn vs upstream FuseBatchNormWithConvPass on identical edge programs.

Prints µs/node for each, the speed-up, and .pte bytes against the ideal (the
bytes of the constants the fused program really needs). Run: python -m benchmarks.bench_fuse
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
from executorch.backends.transforms.fuse_batch_norm_with_conv import FuseBatchNormWithConvPass
from executorch.exir import EdgeProgramManager, to_edge
from torch import nn

from adapters.passes import FuseConvBatchNormPass
from benchmarks.timing import time_pass

warnings.filterwarnings("ignore")


class Chain(nn.Module):
    """``blocks`` x (conv3x3 -> BN -> ReLU)."""

    def __init__(self, blocks: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def edge_program(blocks: int, channels: int) -> EdgeProgramManager:
    model = Chain(blocks, channels).eval()
    return to_edge(torch.export.export(model, (torch.randn(1, channels, 4, 4),)))


def constant_bytes(edge: EdgeProgramManager) -> int:
    ep = edge.exported_program()
    return sum(t.numel() * t.element_size() for t in ep.state_dict.values())


def measure(blocks: int, channels: int, pte: bool, repeats: int) -> dict[str, float]:
    original = edge_program(blocks, channels)
    nodes = len(original.exported_program().graph.nodes)
    ours = min(time_pass(original, FuseConvBatchNormPass)[0] for _ in range(repeats))
    upstream_repeats = 1 if nodes > 2000 else repeats
    theirs = min(time_pass(original, FuseBatchNormWithConvPass)[0] for _ in range(upstream_repeats))
    # fxpure pauses the cyclic GC while it works; show upstream with the same help too
    theirs_nogc = min(time_pass(original, FuseBatchNormWithConvPass, gc_off=True)[0] for _ in range(upstream_repeats))
    row = {
        "nodes": nodes,
        "ours_us": 1e6 * ours / nodes,
        "theirs_us": 1e6 * theirs / nodes,
        "ratio": theirs / ours,
        "ratio_nogc": theirs_nogc / ours,
    }
    if pte:
        fused = copy.deepcopy(original)
        fused = fused.transform([FuseConvBatchNormPass(fused.exported_program())])
        row["ideal"] = constant_bytes(fused)
        row["ours_pte"] = len(fused.to_executorch().buffer)
        upstream = copy.deepcopy(original)
        upstream = upstream.transform([FuseBatchNormWithConvPass(upstream.exported_program())])
        row["theirs_pte"] = len(upstream.to_executorch().buffer)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, nargs="*", default=[25, 100, 400], help="conv+BN+ReLU blocks")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--no-pte", action="store_true", help="skip lowering to .pte")
    parser.add_argument("--repeats", type=int, default=3, help="best of N (upstream: 1 above 2000 nodes)")
    args = parser.parse_args()
    warm = edge_program(2, 8)  # first-call costs (imports, dispatch caches) off the clock, for both
    time_pass(warm, FuseConvBatchNormPass)
    time_pass(warm, FuseBatchNormWithConvPass)
    print(
        f"{'nodes':>6} {'fxpure µs/node':>15} {'upstream µs/node':>17} {'speed-up':>9} "
        f"{'(upstream GC off)':>18} {'fxpure .pte/ideal':>18} {'upstream .pte/ideal':>20}"
    )
    rows = []
    for blocks in args.blocks:
        r = measure(blocks, args.channels, not args.no_pte, args.repeats)
        rows.append(r)
        pte = f"{r['ours_pte'] / r['ideal']:>18.4f} {r['theirs_pte'] / r['ideal']:>20.4f}" if "ideal" in r else ""
        print(
            f"{r['nodes']:>6.0f} {r['ours_us']:>15.1f} {r['theirs_us']:>17.1f} {r['ratio']:>8.1f}x "
            f"{r['ratio_nogc']:>17.1f}x {pte}",
            flush=True,
        )
    if len(rows) > 1:
        growth = rows[-1]["ours_us"] / rows[0]["ours_us"]
        print(
            f"fxpure µs/node growth {rows[0]['nodes']:.0f} -> {rows[-1]['nodes']:.0f} nodes: {growth:.2f}x; "
            f"upstream: {rows[-1]['theirs_us'] / rows[0]['theirs_us']:.2f}x"
        )


if __name__ == "__main__":
    main()
