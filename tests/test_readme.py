"""The README's examples run as written and do what they say; its lists match the code."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import torch

import fxpure.weights
from adapters.passes import RulesPass
from adapters.realize import TransformOutcome
from fxpure.rules import RULES
from tests.models import ResBlock, ResNetish, example, randomize_bn
from tests.programs import assert_close, count, run_pte

README = (Path(__file__).parent.parent / "README.md").read_text()
COMMON = {
    "not-constant",
    "symbolic-shape",
    "malformed-node",
    "plan-conflict",
    "bad-weight-expr",
    "non-finite-weight",
    "weight-underflow",
    "in-subgraph",
    "module-call",
    "preserved-signature",
    "op-not-allowed",
    "written-between",
    "dim-order-changes",
    "unsupported-argument",
}


def _run_example(index: int) -> tuple[dict[str, object], torch.nn.Module, tuple[torch.Tensor, ...]]:
    code = re.findall(r"```python\n(.*?)```", README, re.S)[index]
    torch.manual_seed(0)
    model = randomize_bn(ResNetish())
    x = example(model)
    scope: dict[str, object] = {"model": model, "example_inputs": x}
    exec(compile(code, "README.md", "exec"), scope)
    return scope, model, x


def test_readme_lowering_example_fuses_every_bn_and_the_pte_computes_the_model() -> None:
    scope, model, x = _run_example(0)
    fuse, pte = scope["fuse"], scope["pte"]
    assert isinstance(fuse, RulesPass) and fuse.last is not None and isinstance(pte, bytes)
    bns = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert [p.rule for p in fuse.last.report.plans] == ["fuse-conv-bn"] * bns
    # the residual adds (one per block) read two activations: no candidates of fold-binary
    assert sum(isinstance(m, ResBlock) for m in model.modules()) > 0
    assert fuse.last.report.rejections == ()
    with torch.no_grad():
        want = [model.eval()(*x)]
    assert_close(run_pte(pte, x), want, rel=1e-4)
    # the direct call: the same fusions on the aten program
    outcome, exported = scope["outcome"], scope["exported"]
    assert isinstance(outcome, TransformOutcome) and isinstance(exported, torch.export.ExportedProgram)
    assert len(outcome.report.plans) == bns and count(exported, "batch_norm") == 0


def test_readme_vulkan_example_packs_every_conv_and_lowers_through_vulkan() -> None:
    scope, model, _ = _run_example(1)
    packing, pte = scope["packing"], scope["vulkan_pte"]
    assert isinstance(packing, RulesPass) and packing.last is not None and isinstance(pte, bytes)
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert len(packing.last.report.plans) == convs and packing.last.report.rejections == ()
    assert pte[4:8] == b"ET12" and b"VulkanBackend" in pte


def test_readme_reason_codes_are_each_rules_codes() -> None:
    section = README.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    common = set(re.findall(r"`([a-z-]+)`", section.split("| rule |", 1)[0]))
    assert common == COMMON
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| (.*) \|$", section, re.M))
    assert set(rows) == set(RULES)
    for name, make in RULES.items():
        codes = getattr(make(), "codes", None)  # pattern rules and hand-written ones both list theirs
        assert isinstance(codes, frozenset), name
        assert set(re.findall(r"`([a-z-]+)`", rows[name])) | COMMON == codes, name


def test_readme_lists_every_weight_expression() -> None:
    listed = re.search(r'A `WeightExpr` is `\{"type": (.*?), \.\.\.its fields', README, re.S)
    assert listed is not None
    names = set(re.findall(r'"(\w+)"', listed.group(1)))
    assert names == {cls.__name__ for cls in typing.get_args(fxpure.weights.WeightExpr)}
