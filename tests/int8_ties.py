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
    answer. The rewrite's own quantizes (the views it requantizes) are not compared. Returns the
    number of such ties (the caller bounds it)."""
    want, got = values(original, x), values(rewritten, x)
    before, after = quantizes(original), quantizes(rewritten)
    assert before and set(before) <= set(after)
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
        # the rewrite's quantize may read a value its own requantized views already rounded (half a
        # step off the float at a tie) where the original's read the float itself
        limit = 1e-6 * want[source.name].abs().max() + (0.5 * float(scale) if _rounded(after[name]) else 0.0)
        assert bool(((fa - fb).abs() <= limit).all()), name
        ties += int(off.sum())
    return ties


def _rounded(quantize: torch.fx.Node) -> bool:
    """Whether a quantize reads, through views, a dequantize's result (a value on its grid)."""
    source: Any = quantize.args[0]
    while any(v in str(source.target) for v in ("permute", "squeeze", "view")):
        source = source.args[0]
    return "dequantize_per_tensor" in str(source.target)


def _input(node: torch.fx.Node) -> str:
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    return source.name
