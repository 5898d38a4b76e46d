"""Comparing the int8 activations of two quantized programs that compute the same float values
in a different order (a linear as a 1x1 conv, a conv1d as a conv2d)."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

from tests.quantized import values


def quantizes(ep: ExportedProgram) -> dict[str, torch.fx.Node]:
    """Every quantize node (an int8 activation), by name."""
    return {n.name: n for n in ep.graph.nodes if "quantized_decomposed.quantize_per_tensor" in str(n.target)}


def assert_int8_equal(original: ExportedProgram, rewritten: ExportedProgram, x: tuple[torch.Tensor, ...]) -> int:
    """Every int8 activation of ``rewritten`` equals ``original``'s, bit for bit, except where the
    float being quantized lies on a rounding tie (``x / scale`` within 1e-4 of ``k + 0.5``) and the
    two float values differ only by float32 rounding: there, one step either way is the same
    answer. Returns the number of such ties (the caller bounds it)."""
    want, got = values(original, x), values(rewritten, x)
    before, after = quantizes(original), quantizes(rewritten)
    assert before and sorted(before) == sorted(after)
    ties = 0
    for name, node in before.items():
        a, b = want[name], got[name]
        assert a.dtype == b.dtype == torch.int8 and a.shape == b.shape, name
        off = a != b
        if not off.any():
            continue
        source: Any = node.args[0]
        fa, fb = want[source.name][off], got[_input(after[name])][off]
        scale: Any = node.args[1]
        scaled = fa / float(scale)
        assert int((a.int() - b.int()).abs().max()) == 1, name
        assert bool(((scaled - scaled.floor() - 0.5).abs() < 1e-4).all()), f"{name}: a mismatch off a rounding tie"
        assert bool(((fa - fb).abs() <= 1e-6 * want[source.name].abs().max()).all()), name
        ties += int(off.sum())
    return ties


def _input(node: torch.fx.Node) -> str:
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    return source.name
