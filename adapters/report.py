"""Readable and JSON forms of a RewriteReport, with source locations from node meta."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fxpure.plan import RewriteReport
from fxpure.serial import JSON, to_data

SCHEMA = "fxpure.report/1"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def origins(report: RewriteReport) -> Callable[[str], str]:
    """Maps a node name to the original program's node it stands for (through earlier rewrites)."""
    made = {n.name: n.provenance for p in report.plans for n in p.nodes}

    def origin(name: str) -> str:
        seen: set[str] = set()
        while name not in report.before.index and name in made and name not in seen:
            seen.add(name)
            name = made[name] or name
        return name

    return origin


Metas = dict[str, dict[str, Any]]


def node_meta(gm: torch.fx.GraphModule) -> Metas:
    """Every node's meta by name; take it before a transform erases the nodes."""
    return {n.name: n.meta for n in gm.graph.nodes}


def location(metas: Metas, name: str) -> dict[str, str]:
    """Module path (from ``nn_module_stack``) and source line (from ``stack_trace``) of a node."""
    meta = metas.get(name)
    if meta is None:
        return {"module": "", "source": ""}
    stack: dict[str, Any] = meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        path, cls = list(stack.values())[-1]
        module = f"{path} ({str(cls).rsplit('.', 1)[-1]})" if path else str(cls).rsplit(".", 1)[-1]
    frames = _FRAME.findall(meta.get("stack_trace") or "")
    user = [f for f in frames if "/torch/" not in f[0]] or frames
    source = f"{user[-1][0]}:{user[-1][1]}" if user else ""
    return {"module": module, "source": source}


def rows(report: RewriteReport, metas: Metas) -> list[dict[str, JSON]]:
    """One row per candidate (plans, then rejections): rule, anchor, the program's node it stands
    for (``origin``: itself, or the node an earlier rule's rewrite made it from), outcome, reason,
    location."""
    out: list[dict[str, JSON]] = []
    origin = origins(report)
    for p in report.plans:
        where = location(metas, origin(p.anchor))
        instead = p.instead_of
        outcome = "will rewrite" if instead is None else "fallback"
        code, message = ("", "") if instead is None else (instead.code, instead.message)
        out.append(
            {
                "rule": p.rule,
                "anchor": p.anchor,
                "origin": origin(p.anchor),
                "outcome": outcome,
                "code": code,
                "message": message,
                **where,
            }
        )
    for r in report.rejections:
        where = location(metas, origin(r.node))
        out.append(
            {
                "rule": r.rule,
                "anchor": r.node,
                "origin": origin(r.node),
                "outcome": "declined",
                "code": r.reason.code,
                "message": r.reason.message,
                **where,
            }
        )
    return out


def _counts(report: RewriteReport, rule: str) -> tuple[int, Counter[str], Counter[str]]:
    """Plans of a rule, its fallbacks per the reason they stand in for, its declines per reason."""
    planned = sum(1 for p in report.plans if p.rule == rule)
    fallback = Counter(p.instead_of.code for p in report.plans if p.rule == rule and p.instead_of is not None)
    return planned, fallback, Counter(r.reason.code for r in report.rejections if r.rule == rule)


def summary(report: RewriteReport, rules: list[str]) -> dict[str, JSON]:
    """Counts per rule: plans (fallbacks among them, per reason), and declines per reason code."""
    out: dict[str, JSON] = {}
    for rule in rules:
        planned, fallback, declined = _counts(report, rule)
        out[rule] = {"planned": planned, "fallback": dict(fallback), "declined": dict(declined)}
    return out


def to_json(report: RewriteReport, metas: Metas, rules: list[str], **extra: JSON) -> dict[str, JSON]:
    """The documented JSON document (see README, "JSON schema")."""
    return {
        "schema": SCHEMA,
        **extra,
        "rules": list(rules),
        "candidates": list(rows(report, metas)),
        "plans": [to_data(p) for p in report.plans],
        "summary": summary(report, rules),
    }


def table(report: RewriteReport, metas: Metas, rules: list[str]) -> str:
    """A plain-text table of every candidate and a summary line per rule."""
    lines = []
    data = rows(report, metas)
    if data:
        head = ("rule", "anchor", "outcome", "module", "source", "reason")
        body = [
            (
                str(r["rule"]),
                str(r["anchor"]) + ("" if r["origin"] == r["anchor"] else f" (from {r['origin']})"),
                str(r["outcome"]),
                str(r["module"]),
                str(r["source"]),
                f"{r['code']}: {r['message']}" if r["code"] else "",
            )
            for r in data
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head) - 1)]
        for row in [head, *body]:
            cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
    for rule in rules:
        planned, fallback, declined = _counts(report, rule)
        reasons = ", ".join(f"{v} {k}" for k, v in sorted(declined.items()))
        instead = ", ".join(f"{v} {k}" for k, v in sorted(fallback.items()))
        line = f"{rule}: {planned} to rewrite" + (f" ({fallback.total()} by fallback: {instead})" if instead else "")
        line += f", {declined.total()} declined"
        lines.append(line + (f" ({reasons})" if reasons else ""))
    return "\n".join(lines)
