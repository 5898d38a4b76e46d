"""docs/writing-rules.md runs as written: the rule (at most 40 lines), its torch-free test (at
most 15 lines), and its application to a real exported program."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import adapters
from adapters.validate import check_plans
from tests.models import ScaledConv
from tests.programs import FORMS, assert_sound, build, count

GUIDE = Path(__file__).parent.parent / "docs" / "writing-rules.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_the_guide_keeps_its_promises_on_size() -> None:
    rule, test, _ = blocks()[:3]
    lines = len(rule.splitlines()), len(test.splitlines())  # every line, blank ones included
    assert lines[0] <= 40 and lines[1] <= 15
    text = GUIDE.read_text()
    assert f"of your own: {lines[0]} lines)" in text and f"(torch-free: {lines[1]} lines)" in text


def test_the_rule_its_test_and_its_use_run() -> None:
    rule, test, use = blocks()[:3]
    scope: dict[str, object] = {}
    exec(compile(rule, "writing-rules.md#rule", "exec"), scope)
    assert "fxpure.rules" not in rule  # written as an outside author would
    exec(compile(test, "writing-rules.md#test", "exec"), scope)
    exec(compile(use, "writing-rules.md#use", "exec"), scope)
    outcome = scope["outcome"]
    assert [p.anchor for p in outcome.report.plans] == ["conv2d"]  # type: ignore[attr-defined]


def test_the_node_inserted_after_another_runs() -> None:
    rule, _, use, after = blocks()[:4]
    scope: dict[str, object] = {}
    exec(compile(rule + use, "writing-rules.md#use", "exec"), scope)  # x, torch and adapters
    exec(compile(after, "writing-rules.md#after", "exec"), scope)
    calls = scope["calls"]
    assert calls == [  # every reader of a conv reads its round trip; each conv stays, read by it
        "conv2d",
        "conv2d_nhwc",
        "conv2d_nchw",
        "relu",
        "conv2d_1",
        "conv2d_1_nhwc",
        "conv2d_1_nchw",
    ]
    graph = scope["program"].graph  # type: ignore[attr-defined]
    reads = {n.name: [a.name for a in n.all_input_nodes] for n in graph.nodes}
    assert reads["relu"] == ["conv2d_nchw"] and reads["conv2d_nhwc"] == ["conv2d"]
    assert [n.name for n in graph.output_node().all_input_nodes] == ["conv2d_1_nchw"]


@pytest.mark.parametrize("form", FORMS)
def test_the_inserted_round_trip_in_every_program_form(form: str) -> None:
    rule, _, use, after = blocks()[:4]
    scope: dict[str, object] = {}
    exec(compile(rule + use + after, "writing-rules.md#after", "exec"), scope)
    net, x = scope["net"], scope["x"]
    assert isinstance(net, torch.nn.Module) and isinstance(x, torch.Tensor)
    program = build(net, (x,), form)
    outcome = adapters.transform(program, [scope["nhwc_round_trip"]]).unwrap()  # type: ignore[list-item]
    assert len(outcome.report.plans) == 2 and count(program, "permute") == 4
    assert_sound(program, (x,), [net(x)])


def test_each_inserted_round_trip_checks_as_the_same_values() -> None:
    # check_plans runs each plan on its own: the conv whose uses the round trip takes stays, and
    # the round trip reads its value (not a fresh random one)
    rule, _, use, after = blocks()[:4]
    scope: dict[str, object] = {}
    exec(compile(rule + use + after, "writing-rules.md#after", "exec"), scope)
    net, x = scope["net"], scope["x"]
    assert isinstance(net, torch.nn.Module) and isinstance(x, torch.Tensor)
    program = torch.export.export(net, (x,))
    rules = [scope["nhwc_round_trip"]]
    report = adapters.transform(program, rules, dry_run=True).unwrap().report  # type: ignore[arg-type]
    checks = check_plans(program, report)
    assert [(c.anchor, c.ok, c.max_rel) for c in checks] == [("conv2d", True, 0.0), ("conv2d_1", True, 0.0)]


@pytest.mark.parametrize(
    ("x", "scale"),
    [
        (torch.randn(3, 16, 16), torch.tensor([0.5, 2.0, 4.0]).reshape(1, 3, 1, 1)),  # x * s adds the batch dim
        (torch.randn(2, 1, 16, 16), torch.tensor([0.5, 2.0, 4.0]).reshape(1, 3, 1, 1)),  # x * s makes 3 channels
    ],
)
def test_the_guides_rule_declines_a_scale_that_broadcasts_x(x: torch.Tensor, scale: torch.Tensor) -> None:
    # folded, the conv would read x itself: an unbatched output, or a conv of 3 input channels
    # reading 1 (an outside author found both applied by the guide's first version)
    rule = blocks()[0]
    scope: dict[str, object] = {}
    exec(compile(rule, "writing-rules.md#rule", "exec"), scope)

    model = ScaledConv(scale).eval()
    program = torch.export.export(model, (x,))
    outcome = adapters.transform(program, [scope["fold_input_scale"]]).unwrap()  # type: ignore[list-item]
    assert outcome.report.plans == () and not outcome.changed
    assert [r.reason.code for r in outcome.report.rejections] == ["not-per-input-channel"]
    assert torch.equal(program.module()(x), model(x))


def test_the_numbers_a_plan_derives_are_checked_without_torch() -> None:
    rule, test, _, _, numbers = blocks()[:5]
    scope: dict[str, object] = {}
    exec(compile(rule + test + numbers, "writing-rules.md#numbers", "exec"), scope)
    assert "torch" not in (rule + test + numbers).replace("torch-free", "")
