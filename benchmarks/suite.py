"""Every rule against the FX floor and the upstream pass it replaces, in one run.

For each rule and size: the same freshly copied program for every side, the same repetitions (best
of ``--repeats``), one warm-up of each side first, ``gc.collect()`` before each timed call, and each
side timed with the cyclic garbage collector on and off (fxpure's own pause is disabled for the "on"
runs, so "on" is plain Python for both). Sides:

- fxpure: ``adapters.transform(program, [rule])`` (capture, plan, checks, in-place commit);
- floor: ``benchmarks.floor`` (planned off the clock; weights, nodes, constants, one recompile);
- upstream: the upstream pass called on the graph module, plus ``recompile()`` where the pass
  leaves it to its caller, so every side ends with a runnable program;
- path: the call users write, ``EdgeProgramManager.transform([pass])``, for both (edge programs).

Then capture and planning of every rule on a 50,000-node transformer-style exported program, with
the memory (``tracemalloc``) the snapshot holds against the GraphModule's own.

Writes ``benchmarks/results.json`` and draws ``benchmarks/results.png``. Run: ``make bench``
(``python -m benchmarks.suite [--quick]``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import platform
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from executorch.exir import EdgeProgramManager
from torch.export import ExportedProgram

import adapters.realize
from adapters.passes import RulesPass
from adapters.snap import capture_program
from benchmarks import models
from benchmarks.floor import prepare
from fxpure import plan, rewrite
from fxpure.rules import RULES
from tests.linear_fold_support import arm_stand_in, nxp_stand_in
from tests.quantized import quantize, upstream_pack

HERE = Path(__file__).resolve().parent
Built = EdgeProgramManager | torch.fx.GraphModule
Pass = Callable[[torch.fx.GraphModule], object]


@dataclass(frozen=True)
class Case:
    rule: str
    block: str  # what one unit of size is
    sizes: tuple[int, ...]
    build: Callable[[int], Built]
    upstream: str = ""  # the upstream pass, named for the table ("" if there is none to run here)
    make_upstream: Callable[[ExportedProgram | None], Pass] | None = None
    recompile_upstream: bool = False  # the upstream pass leaves recompile() to its caller
    path: bool = True  # upstream's pass object goes into EdgeProgramManager.transform


def _import(module: str, name: str) -> Any:
    return getattr(__import__(module, fromlist=[name]), name)


def _upstream(module: str, name: str, *, program: bool = True) -> Callable[[ExportedProgram | None], Pass]:
    def make(ep: ExportedProgram | None) -> Pass:
        cls = _import(module, name)
        made: Pass = cls(ep) if program else cls()
        return made

    return make


def _qconv_upstream(ep: ExportedProgram | None) -> Pass:
    assert ep is not None
    return lambda _: upstream_pack(ep)


X2D = 16  # channels of the conv programs
CASES = [
    Case(
        "fuse-conv-bn",
        "conv3x3+BN+ReLU",
        (25, 100, 400),
        lambda n: models.edge(models.Repeat(n, lambda: models.conv_bn(X2D)), torch.randn(1, X2D, 8, 8)),
        "ExecuTorch FuseBatchNormWithConvPass",
        _upstream("executorch.backends.transforms.fuse_batch_norm_with_conv", "FuseBatchNormWithConvPass"),
    ),
    Case(
        "split-group-conv",
        "grouped conv (g=4)+ReLU",
        (50, 200),
        lambda n: models.export(models.Repeat(n, lambda: models.grouped(32)), torch.randn(1, 32, 8, 8)).module(),
        "NXP SplitGroupConvolution",
        _upstream(
            "executorch.backends.nxp.aten_passes.split_group_convolution", "SplitGroupConvolution", program=False
        ),
        recompile_upstream=True,
    ),
    Case(
        "quantized-conv",
        "int8 conv (3x3, depthwise, 1x1 in turn)",
        (64, 256),
        lambda n: quantize(models.Repeat(n, _qconv_block(X2D)), (torch.randn(1, X2D, 8, 8),)),
        "Vulkan q8ta detector + replacement",
        _qconv_upstream,
        path=False,
    ),
    Case(
        "fuse-linear-bn",
        "linear+BN1d+ReLU",
        (50, 200),
        lambda n: models.edge(models.Repeat(n, lambda: models.linear_bn(32)), torch.randn(4, 32)),
        "XNNPACK FuseBatchNormPass",
        _upstream("executorch.backends.xnnpack._passes.fuse_batch_norm", "FuseBatchNormPass"),
    ),
    Case(
        "fold-binary",
        "conv3x3 * 0.5 + ReLU",
        (50, 200),
        lambda n: models.export(
            models.Repeat(n, lambda: models.ConvMulScalar(X2D)), torch.randn(1, X2D, 8, 8)
        ).module(),
        "Arm FoldScalarMulIntoConvPass",
        _upstream("executorch.backends.arm._passes.fold_scalar_mul_into_conv_pass", "FoldScalarMulIntoConvPass"),
    ),
    Case(
        "conv1d-to-conv2d",
        "conv1d+ReLU",
        (50, 200),
        lambda n: models.edge(models.Repeat(n, lambda: models.conv1d(X2D)), torch.randn(1, X2D, 32)),
        "ExecuTorch ConvertConv1dToConv2dPass",
        _upstream("executorch.backends.transforms.convert_conv1d_to_conv2d_pass", "ConvertConv1dToConv2dPass"),
    ),
    Case(
        "linear-to-conv2d",
        "linear+ReLU (linear kept by to_edge)",
        (50, 200),
        lambda n: models.edge(models.Repeat(n, lambda: models.linear(32)), torch.randn(4, 32), keep_linear=True),
        "Qualcomm ConvertLinearToConv2d",
        _upstream("executorch.backends.qualcomm._passes.convert_linear_to_conv2d", "ConvertLinearToConv2d"),
        recompile_upstream=True,
    ),
    Case(
        "concat-parallel-linears",
        "Q, K, V linears of one input",
        (50, 200),
        lambda n: models.edge(models.Repeat(n, lambda: models.QKV(32)), torch.randn(4, 32)),
    ),
]


def _qconv_block(c: int) -> Callable[[], torch.nn.Module]:
    kinds = iter(range(10**9))

    def block() -> torch.nn.Module:
        k = next(kinds) % 3
        conv = torch.nn.Conv2d(c, c, (3, 3, 1)[k], padding=(1, 1, 0)[k], groups=(1, c, 1)[k])
        return torch.nn.Sequential(conv, torch.nn.ReLU())

    return block


def _program(built: Built) -> ExportedProgram | torch.fx.GraphModule:
    return built.exported_program() if isinstance(built, EdgeProgramManager) else built


def _nodes(built: Built) -> int:
    p = _program(built)
    return len((p.graph_module if isinstance(p, ExportedProgram) else p).graph.nodes)


@contextlib.contextmanager
def _gc(off: bool) -> Iterator[None]:
    """The cyclic collector off (or on) for the timed call. On: ``gc.disable`` does nothing
    meanwhile, which undoes every pause of fxpure (``no_cyclic_gc``, wherever it is used)."""
    disable = gc.disable
    gc.collect()
    if off:
        gc.disable()
    else:
        gc.disable = lambda: None
    try:
        yield
    finally:
        gc.disable = disable
        gc.enable()


def _call(case: Case, built: Built, side: str) -> Callable[[], object]:
    """The side's call on ``built`` (a fresh copy), everything it needs made off the clock."""
    program = _program(built)
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    ep = program if isinstance(program, ExportedProgram) else None
    rule = RULES[case.rule]()
    if side == "fxpure":
        return lambda: adapters.realize.transform(program, [rule]).unwrap()
    if side == "floor":
        return prepare(program, [rule])
    if side == "capture":
        return lambda: capture_program(program)
    if side == "plan":
        snap = capture_program(program).snap
        return lambda: plan(snap, [rule])
    if side == "fxpure path":
        assert isinstance(built, EdgeProgramManager)
        return lambda: built.transform([RulesPass([rule])])
    assert case.make_upstream is not None
    if side == "upstream path":
        assert isinstance(built, EdgeProgramManager)
        make = case.make_upstream
        return lambda: built.transform([make(built.exported_program())])
    upstream = case.make_upstream(ep)
    if case.recompile_upstream:
        return lambda: (upstream(gm), gm.recompile())
    return lambda: upstream(gm)


def _time(case: Case, original: Built, side: str, *, gc_off: bool) -> float:
    call = _call(case, copy.deepcopy(original), side)
    with _gc(gc_off):
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0


def _sides(case: Case, built: Built) -> list[str]:
    sides = ["fxpure", "floor"]
    if case.make_upstream is not None:
        sides.append("upstream")
    if isinstance(built, EdgeProgramManager):
        sides.append("fxpure path")
        if case.make_upstream is not None and case.path:
            sides.append("upstream path")
    return sides


def measure(case: Case, size: int, repeats: int) -> dict[str, Any]:
    original = case.build(size)
    sides = _sides(case, original)
    best: dict[str, float] = {}
    for _ in range(repeats):  # interleaved: every side sees the same phases of the machine's load
        for side in sides:
            for off in (False, True):
                key = f"{side}{' gc off' if off else ''}"
                best[key] = min(best.get(key, float("inf")), _time(case, original, side, gc_off=off))
        for phase in PHASES:  # parts of "fxpure gc off": the collector off, as the transform runs them
            best[phase] = min(best.get(phase, float("inf")), _time(case, original, phase, gc_off=True))
    row: dict[str, Any] = {"rule": case.rule, "size": size, "block": case.block, "nodes": _nodes(original)}
    row.update({f"{k} ms": round(1e3 * v, 3) for k, v in best.items()})
    row["upstream pass"] = case.upstream or None
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _fmt(v: Any, width: int) -> str:
    if v is None:
        return f"{'—':>{width}}"
    return f"{v:>{width}.1f}" if isinstance(v, float) else f"{v:>{width}}"


# fxpure's own work before the apply, timed alone: the rest of "fxpure gc off ms" is materialising
# the new weights and editing the graph, which the floor spends too
PHASES = ("capture", "plan")

COLUMNS = [
    ("rule", 24),
    ("size", 5),
    ("nodes", 6),
    ("fxpure ms", 10),
    ("floor ms", 9),
    ("upstream ms", 12),
    ("fxpure/floor", 12),
    ("upstream/fxpure", 15),
    ("capture ms", 10),
    ("plan ms", 8),
    ("fxpure gc off ms", 16),
    ("upstream gc off ms", 18),
    ("fxpure path ms", 14),
    ("upstream path ms", 16),
]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [" ".join(f"{name:>{w}}" for name, w in COLUMNS)]
    for r in rows:
        lines.append(" ".join(_fmt(r.get(name), w) for name, w in COLUMNS))
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as the README shows it (ms; ratios; "—" where there is no upstream pass here)."""
    names = [name for name, _ in COLUMNS]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in rows:
        cells = [_fmt(r.get(name), 0).strip() for name in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth(rows: list[dict[str, Any]], side: str) -> dict[str, float | None]:
    """Per-node cost at the largest size over the smallest, per rule."""
    out: dict[str, float | None] = {}
    for rule in dict.fromkeys(r["rule"] for r in rows):
        mine = [r for r in rows if r["rule"] == rule and r.get(f"{side} ms")]
        if len(mine) > 1:
            lo, hi = mine[0], mine[-1]
            out[rule] = _ratio(hi[f"{side} ms"] / hi["nodes"], lo[f"{side} ms"] / lo["nodes"])
    return out


def transformer(blocks: int) -> ExportedProgram:
    """A transformer-style exported program (about 40 nodes per block), cached under .cache/."""
    path = HERE / ".cache" / f"transformer-{blocks}.pt2"
    if path.exists():
        return torch.export.load(path)
    ep = models.export(models.Repeat(blocks, lambda: models.Block(32, 4)), torch.randn(1, 8, 32))
    path.parent.mkdir(exist_ok=True)
    torch.export.save(ep, path)
    return ep


def _retained(make: Callable[[], object]) -> tuple[int, object]:
    """Bytes of Python memory still held by what ``make`` returns (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    value = make()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, value


def scale(blocks: int, repeats: int) -> dict[str, Any]:
    """Capture and planning of every rule on a transformer-style program: as shipped (both pause
    the cyclic collector) and with the collector running throughout (the pauses undone)."""
    ep = transformer(blocks)
    rules = [make() for make in RULES.values()]
    runs = []
    for shipped in (True, False):
        for _ in range(repeats):
            with contextlib.nullcontext() if shipped else _gc(False):
                gc.collect()
                t0 = time.perf_counter()
                cap = capture_program(ep)
                t1 = time.perf_counter()
                report = plan(cap.snap, rules)
                t2 = time.perf_counter()
            runs.append((shipped, t1 - t0, t2 - t1, len(report.plans), len(report.rejections)))
            del cap, report  # the next run starts with nothing of this one alive for the collector to scan
    best = min((r for r in runs if r[0]), key=lambda r: r[1] + r[2])
    best_on = min((r for r in runs if not r[0]), key=lambda r: r[1] + r[2])
    # where planning goes: each rule's stage alone (its candidates, plans and rewrite), on the snapshot
    # the rules before it left, as ``plan`` runs them (best of the repeats, collector paused)
    snap = capture_program(ep).snap
    stages: dict[str, dict[str, Any]] = {}
    one: list[float] = []
    for rule in rules:
        times = []
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            step = plan(snap, [rule])
            times.append(time.perf_counter() - t0)
        stages[rule.name] = {"s": round(min(times), 3), "plans": len(step.plans), "nodes after": len(step.after.nodes)}
        if step.plans and not one:  # a stage of a single plan on the whole program: what its rewrite costs
            one.append(_best_ms(rewrite, snap, step.plans[:1], repeats=repeats))
        snap = step.after
    del snap, step
    snap_bytes, _ = _retained(lambda: capture_program(ep).snap)
    gm_bytes, _ = _retained(lambda: copy.deepcopy(ep.graph_module))
    return {
        "nodes": len(ep.graph.nodes),
        "capture s": round(best[1], 3),
        "plan s": round(best[2], 3),
        "capture+plan s": round(best[1] + best[2], 3),
        "capture+plan gc on s": round(best_on[1] + best_on[2], 3),
        "plans": best[3],
        "rejections": best[4],
        "stages": stages,
        "rewrite of one plan ms": one[0] if one else None,
        "snapshot MB": round(snap_bytes / 2**20, 1),
        "graph module MB": round(gm_bytes / 2**20, 1),
    }


def _best_ms(run: Callable[..., object], *args: object, repeats: int) -> float:
    """The least time of ``repeats`` calls of ``run(*args)``, in ms (collector paused, as ``plan`` runs)."""
    times = []
    with _gc(True):
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(*args)
            times.append(time.perf_counter() - t0)
    return round(min(times) * 1000, 1)


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = list(dict.fromkeys(r["rule"] for r in rows))
    fig, axes = plt.subplots(2, (len(rules) + 1) // 2, figsize=(4 * ((len(rules) + 1) // 2), 7), squeeze=False)
    for ax, rule in zip(axes.flat, rules, strict=False):
        mine = [r for r in rows if r["rule"] == rule]
        for side, style in (("fxpure", "o-"), ("floor", "s--"), ("upstream", "^:")):
            points = [(r["nodes"], 1e3 * r[f"{side} ms"] / r["nodes"]) for r in mine if r.get(f"{side} ms")]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=side)
        ax.set(xscale="log", yscale="log", title=rule, xlabel="nodes", ylabel="µs per node")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(rules) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for every side")
    parser.add_argument("--quick", action="store_true", help="small sizes only, no 50k-node program")
    parser.add_argument("--rules", nargs="*", default=[c.rule for c in CASES])
    parser.add_argument("--blocks", type=int, default=1250, help="transformer blocks (about 40 nodes each)")
    args = parser.parse_args()
    nxp_stand_in()
    arm_stand_in()
    started = time.time()
    # the 50k-node program first, in a fresh process: the cases below leave many objects alive,
    # which the collector (with its pause undone for the "GC on" figure) would scan too
    big = None if args.quick else scale(args.blocks, args.repeats)
    rows: list[dict[str, Any]] = []
    for case in (c for c in CASES if c.rule in args.rules):
        warm = case.build(2)
        for side in _sides(case, warm):
            _time(case, warm, side, gc_off=False)
        for size in case.sizes[:1] if args.quick else case.sizes:
            row = measure(case, size, args.repeats)
            row["fxpure/floor"] = _ratio(row["fxpure ms"], row["floor ms"])
            row["upstream/fxpure"] = _ratio(row.get("upstream ms"), row["fxpure ms"])
            rows.append(row)
            print(table([row]).splitlines()[1] if len(rows) > 1 else table([row]), flush=True)
    print()
    print(table(rows))
    print()
    print(markdown(rows))
    growth_fx, growth_floor = growth(rows, "fxpure"), growth(rows, "floor")
    print("\nper-node cost, largest size over smallest:")
    growth_up = growth(rows, "upstream")
    for rule, g in growth_fx.items():
        print(f"  {rule:<24} fxpure {g}x   floor {growth_floor.get(rule)}x   upstream {growth_up.get(rule)}x")
    result: dict[str, Any] = {
        "run": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.python_version()}",
            "torch": torch.__version__,
            "repeats": args.repeats,
            "command": "make bench" if not args.quick else "python -m benchmarks.suite --quick",
        },
        "rows": rows,
        "growth": {"fxpure": growth_fx, "floor": growth_floor},
    }
    if big is not None:
        result["scale"] = big
        print(
            f"\n{big['nodes']}-node transformer (aten): capture {big['capture s']} s + plan (all {len(RULES)} rules) "
            f"{big['plan s']} s = {big['capture+plan s']} s "
            f"(collector running throughout: {big['capture+plan gc on s']} s); "
            f"{big['plans']} plans, {big['rejections']} rejections; snapshot {big['snapshot MB']} MB "
            f"vs GraphModule {big['graph module MB']} MB"
        )
        print(
            "  planning, each rule's stage alone: "
            + ", ".join(
                f"{rule} {st['s']} s ({st['plans']} plans)"
                for rule, st in big["stages"].items()
                if st["plans"] or st["s"] >= 0.01
            )
            + f"; a stage of one plan: its rewrite {big['rewrite of one plan ms']} ms"
        )
    result["run"]["seconds"] = round(time.time() - started)
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(rows, HERE / "results.png")
    print(f"\nwrote {HERE / 'results.json'} and {HERE / 'results.png'} ({result['run']['seconds']} s)")


if __name__ == "__main__":
    main()
