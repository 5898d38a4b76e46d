"""The ``fxpure`` command line: ``fxpure demo``."""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def _timed(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    out = fn()
    print(f"  {label:<34} {1e3 * (time.perf_counter() - t0):8.1f} ms")
    return out


def demo() -> int:
    """Export the embedded CNN, fuse conv+BN, check numerics, lower to .pte and run it."""
    warnings.filterwarnings("ignore")
    import torch
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    from adapters.demo_model import demo_model
    from adapters.passes import FuseConvBatchNormPass

    def run_pte(buffer: bytes, x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        method = Runtime.get().load_program(buffer).load_method("forward")
        assert method is not None
        method.execute(list(x))  # warm-up
        t0 = time.perf_counter()
        for _ in range(20):
            out = method.execute(list(x))[0]
        return out, (time.perf_counter() - t0) / 20 * 1e3

    print("fxpure demo: conv + batch-norm fusion on an embedded CNN")
    model, x = demo_model()
    with torch.no_grad():
        want = model(*x)
    exported = _timed("torch.export", lambda: torch.export.export(model, x))
    plain = _timed("to_edge (unfused copy)", lambda: to_edge(copy.deepcopy(exported)))
    edge = _timed("to_edge", lambda: to_edge(exported))
    fuse = FuseConvBatchNormPass(edge.exported_program())
    edge = _timed("fxpure FuseConvBatchNormPass", lambda: edge.transform([fuse]))
    if fuse.last is None:
        print("error: the pass did not run", file=sys.stderr)
        return 1
    report = fuse.last.report
    print(f"\n  fused {len(report.plans)} batch norms:")
    for p in report.plans:
        print(f"    {p.anchor:<52} -> {p.nodes[0].name}")
    print(f"  declined {len(report.rejections)}:")
    for r in report.rejections:
        print(f"    {r.node:<52} {r.reason.code}: {r.reason.message}")
    program = edge.exported_program()
    with torch.no_grad():
        got = program.module()(*x)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"\n  numerics vs eager: max relative error {rel:.2e}")
    plain_pte = _timed("lower unfused program to .pte", lambda: plain.to_executorch().buffer)
    fused_pte = _timed("lower fused program to .pte", lambda: edge.to_executorch().buffer)
    _, ms_before = run_pte(plain_pte, x)
    out_after, ms_after = run_pte(fused_pte, x)
    rt_rel = ((out_after - want).abs().max() / want.abs().max()).item()
    print(f"  ExecuTorch runtime vs eager: max relative error {rt_rel:.2e}")
    print(f"\n  {'':<12} {'.pte bytes':>12} {'runtime ms':>11}")
    print(f"  {'before':<12} {len(plain_pte):>12,} {ms_before:>11.3f}")
    print(f"  {'after':<12} {len(fused_pte):>12,} {ms_after:>11.3f}")
    ok = rel < 1e-4 and rt_rel < 1e-4
    print("\nok" if ok else "\nFAILED: numerics differ", flush=True)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxpure`` console script."""
    parser = argparse.ArgumentParser(prog="fxpure", description="pure-functional graph rewrites for torch.fx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="fuse conv+BN on an embedded CNN, lower to .pte and run it")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
