"""docs/writing-rules.md runs as written: the rule (at most 40 lines), its torch-free test (at
most 15 lines), and its application to a real exported program."""

from __future__ import annotations

import re
from pathlib import Path

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
