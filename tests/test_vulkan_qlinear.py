"""The outside author's Vulkan int8 linear rules (``tests/vulkan_qlinear.py``) on real PT2E edge
programs: the kernels chosen, the declines, the new constants (the program's own left intact), an
oracle of the kernels run on the rewritten program against the PT2E program's output, the Vulkan
lowering, and upstream's pass on the same models.

The oracle (``_kernel``) is written from upstream's shaders (``q8ta_linear.glsl``,
``q8ta_linear_gemv.glsl``, ``linear_fp_output_tile_int8_int8_compute.glslh``), never from the plans:
``acc = sum_k x_q * w_q`` (exact), ``(acc - weight_sums[n] * input_zp) * weight_scales[n] * input_scale
+ bias[n]``, relu if asked, ``round(. / output_scale) + output_zp`` clamped to int8; the gemv kernel
reads the first row only; ``linear_q8ta_q8csw`` quantizes its float input first and returns float.
The CPU reference kernels of ``custom_ops_lib`` are no such oracle: they
ignore ``weight_sums``, cannot take scales padded to 4 (which the kernels need, and upstream's pass
writes), and ``linear_q8ta_q8csw``'s never dequantizes its int8 input (tests below)."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import executorch.backends.vulkan.custom_ops_lib  # type: ignore[import-untyped]  # noqa: F401  (the et_vk ops)
import pytest
import torch
from executorch.backends.transforms.addmm_mm_to_linear import AddmmToLinearTransform  # type: ignore[import-untyped]
from executorch.backends.vulkan._passes.fuse_patterns import FusePatternsPass  # type: ignore[import-untyped]
from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner
from executorch.backends.vulkan.vulkan_preprocess import apply_passes  # type: ignore[import-untyped]
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from executorch.exir import to_edge, to_edge_transform_and_lower
from torch import nn
from torch.export import ExportedProgram
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import adapters
from tests.quantized import pt2e
from tests.vulkan_qlinear import RULES


class Lin(nn.Module):
    def __init__(self, k: int = 8, n: int = 6, *, relu: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.fc, self.relu = nn.Linear(k, n, bias=bias), relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return torch.relu(y) if self.relu else y


class Chain(nn.Module):
    """Three linears in a row (ET PR #17567: a rewrite rewired the next match's input, whose qparams
    it then read wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c(self.b(torch.relu(self.a(x))))
        return out


class Shared(nn.Module):
    """One linear on two inputs: two dequantizes of one int8 weight, one scale buffer, one bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.fc(y)


def _x(*shape: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(*shape),)


BATCHED = ["batched-input", "batched-input"]  # (each rule declines it: the quantize's, then the linear's)
# model, inputs, the et_vk ops the rules write, the reasons they decline with
MODELS: dict[str, tuple[Any, tuple[torch.Tensor, ...], dict[str, int], list[str]]] = {
    "linear": (lambda: Lin(), _x(4, 8), {"q8ta_linear": 1}, []),
    "aligned": (lambda: Lin(8, 8), _x(4, 8), {"q8ta_linear": 1}, []),
    "relu": (lambda: Lin(relu=True), _x(4, 8), {"q8ta_linear": 1}, []),
    "no_bias": (lambda: Lin(bias=False), _x(4, 8), {"q8ta_linear": 1}, []),
    "gemv": (lambda: Lin(), _x(1, 8), {"q8ta_linear_gemv": 1}, []),
    "3d": (lambda: Lin(relu=True), _x(1, 5, 8), {"q8ta_linear": 1}, []),
    "3d_gemv": (lambda: Lin(), _x(1, 1, 8), {"q8ta_linear_gemv": 1}, []),
    "chain": (lambda: Chain(), _x(4, 8), {"q8ta_linear": 3}, []),
    "shared": (lambda: Shared(), (torch.randn(4, 8), torch.randn(1, 8)), {"q8ta_linear": 1, "q8ta_linear_gemv": 1}, []),
    # the scale read elsewhere too: by the dequantize of a linear the rules decline (a batch of 2)
    "shared_declined": (lambda: Shared(), (torch.randn(4, 8), torch.randn(2, 3, 8)), {"q8ta_linear": 1}, BATCHED),
    # outputs not quantized (a config without output_activation): linear_q8ta_q8csw
    "float_out": (lambda: Lin(), _x(4, 8), {"linear_q8ta_q8csw": 1}, []),
    "float_out_3d": (lambda: Lin(relu=True, bias=False), _x(1, 3, 8), {"linear_q8ta_q8csw": 1}, []),
    "k6": (lambda: Lin(6, 8), _x(4, 6), {}, ["channel-alignment", "channel-alignment"]),
    "batched": (lambda: Lin(), _x(2, 3, 8), {}, BATCHED),
}


def _pt2e(name: str) -> tuple[ExportedProgram, tuple[torch.Tensor, ...]]:
    """PT2E with XNNPACKQuantizer, symmetric int8 per channel (for ``float_out*``, outputs not quantized)."""
    make, x, _, _ = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    if not name.startswith("float_out"):
        return pt2e(model, x), x
    config = get_symmetric_quantization_config(is_per_channel=True)
    quantizer = XNNPACKQuantizer().set_global(dataclasses.replace(config, output_activation=None))
    prepared = prepare_pt2e(torch.export.export(model, x).module(), quantizer)
    prepared(*x)
    return torch.export.export(convert_pt2e(prepared), x), x


def _edge(name: str) -> tuple[ExportedProgram, tuple[torch.Tensor, ...]]:
    program, x = _pt2e(name)
    return to_edge(program).exported_program(), x


def _et_vk(ep: ExportedProgram) -> Counter[str]:
    return Counter(str(n.target).split(".")[-2] for n in ep.graph.nodes if "et_vk" in str(n.target))


def _kernel(op: str, x: torch.Tensor, x_scale: float, x_zp: int, w: torch.Tensor, sums: torch.Tensor,
            scales: torch.Tensor, *rest: Any) -> torch.Tensor:  # fmt: skip
    """What the shaders compute from the call's arguments (see the module docstring)."""
    if op == "linear_q8ta_q8csw":  # its input is float: quantized first (quantize_and_pack_linear_input)
        (bias,) = rest or (None,)
        o_scale, o_zp, activation = None, 0, "none"
        x = (torch.round(x.double() / x_scale) + x_zp).clamp(-128, 127)
    else:
        o_scale, o_zp, bias, activation = (*rest, "none")[:4] if len(rest) < 4 else rest
    n, k = w.shape
    assert k % 4 == 0 and sums.numel() % 4 == 0 and scales.numel() % 4 == 0  # read a texel at a time
    assert bias is None or bias.numel() % 4 == 0
    # the rows the kernels compute: sizes[-2] rows of batch 0 (the gemv kernel: the first row); the
    # rest of the output is never written (zeros here)
    m = 1 if op == "q8ta_linear_gemv" else x.shape[-2]
    rows = torch.zeros(x.reshape(-1, k).shape, dtype=torch.float64)
    rows[:m] = x.reshape(-1, k)[:m].double()
    acc = rows @ w.double().T
    out = (acc - sums[:n].double() * x_zp) * scales[:n].double() * x_scale
    if bias is not None:
        out = out + bias[:n].double()
    if activation == "relu":
        out = out.clamp(min=0)
    shape = (*x.shape[:-1], n)
    out[m:] = 0
    if o_scale is None:
        return out.float().reshape(shape)
    q = (torch.round(out / o_scale) + o_zp).clamp(-128, 127)
    q[m:] = 0
    return q.to(torch.int8).reshape(shape)


class _Oracle(torch.fx.Interpreter):
    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if "et_vk" in str(target):
            return _kernel(str(target).split(".")[-2].split(" ")[0], *args, *kwargs.values())
        return super().call_function(target, args, kwargs)


def _outputs(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple | list) else [value]


def _steps(ep: ExportedProgram) -> list[float]:
    """Each output's quantization step: the scale of the dequantize that makes it."""
    (out,) = [n for n in ep.graph.nodes if n.op == "output"]
    return [float(a.args[1]) if "dequantize" in str(a.target) else 1e-5 for a in out.args[0]]


def _oracle(ep: ExportedProgram, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    gm = ep.module()
    with torch.no_grad():
        return _outputs(_Oracle(gm).run(*x))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernels_declines_and_the_oracle(name: str) -> None:
    ep, x = _edge(name)
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, list(RULES)).unwrap().report
    _, _, kernels, codes = MODELS[name]
    assert _et_vk(ep) == Counter(kernels)
    assert sorted(r.reason.code for r in report.rejections) == codes
    # no dequantize of a weight left where every linear was rewritten
    weights_dq = sum("dequantize_per_channel" in str(n.target) for n in ep.graph.nodes)
    assert weights_dq == len(codes) // 2  # (only a declined linear keeps its weight's dequantize)
    want, got = _outputs(original.module()(*x)), _oracle(ep, x)
    for a, b, step in zip(want, got, _steps(original), strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= step * 1.001 + 1e-6, name


@pytest.mark.parametrize("name", ["linear", "shared", "shared_declined", "float_out"])
def test_the_programs_constants_stay_as_they_were(name: str) -> None:
    # sums, scales and bias padded to 4 are new constants: the program's own 6-vectors are intact
    # (and dropped when nothing reads them any more)
    ep, _ = _edge(name)
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    outcome = adapters.transform(ep, list(RULES)).unwrap()
    news = {c.name for p in outcome.report.plans for c in p.constants}
    assert any(n.endswith("_sums") for n in news) and any("scale" in n and n.endswith("_padded") for n in news)
    for key, value in ep.state_dict.items():
        if key in before:
            assert torch.equal(value, before[key]), key
    shapes = {n.name: tuple(n.meta["val"].shape) for n in ep.graph.nodes if n.op == "placeholder"}
    assert all(v[0] % 4 == 0 for k, v in shapes.items() if k.endswith("_padded") or k.endswith("_sums"))


def test_the_reference_kernels_are_an_oracle_only_for_aligned_channels() -> None:
    ep, x = _edge("aligned")  # 8 outputs: no padding; the reference then agrees with the shaders' math
    adapters.transform(ep, list(RULES)).unwrap()
    ref, oracle = _outputs(ep.module()(*x)), _oracle(ep, x)
    assert all(torch.equal(a, b) or (a - b).abs().max() <= 0.05 for a, b in zip(ref, oracle, strict=True))
    ep, x = _edge("linear")  # 6 outputs: the scales the kernels read a texel at a time are padded to 8
    adapters.transform(ep, list(RULES)).unwrap()
    with pytest.raises(RuntimeError, match="size of tensor"):
        ep.module()(*x)
    xq = torch.randint(-128, 128, (4, 8), dtype=torch.int8)
    w = torch.randint(-127, 128, (8, 8), dtype=torch.int8)
    s = torch.rand(8) / 100
    sums = w.sum(1).to(torch.int32)
    args = (xq, 0.02, 3, w)
    # the reference ignores the sums (the input zero point's correction)...
    assert torch.equal(
        torch.ops.et_vk.q8ta_linear(*args, sums, s, 0.05, 0), torch.ops.et_vk.q8ta_linear(*args, sums * 0, s, 0.05, 0)
    )
    # ...and linear_q8ta_q8csw's never dequantizes its int8 input
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.et_vk.linear_q8ta_q8csw(*args, sums, s)


def _upstream(ep: ExportedProgram) -> ExportedProgram:
    """Upstream's pass as ``vulkan_preprocess`` runs it on a partition: addmm to linear, then
    ``FusePatternsPass`` (its quantized-linear detector and replacement among them)."""
    done: ExportedProgram = apply_passes(ep, [AddmmToLinearTransform(), FusePatternsPass()])
    return done


# what upstream's pass does to each model: the et_vk ops it writes, the program's constants it pads
# in place, and whether the kernels' oracle then agrees with the PT2E program (None: it raises)
UPSTREAM: dict[str, tuple[dict[str, int], set[str], bool] | None] = {
    "linear": ({"q8ta_linear": 1}, {"fc.bias", "_scale_0"}, True),
    "no_bias": ({"q8ta_linear": 1}, {"_scale_0"}, True),
    "3d": ({"q8ta_linear": 1}, {"fc.bias", "_scale_0"}, True),
    "chain": ({"q8ta_linear": 3}, {"c.bias", "_scale_2"}, True),
    "aligned": ({"q8ta_linear": 1}, set(), True),
    "k6": ({}, set(), True),  # (skipped, silently)
    # a (2, 3, 8) input passed as it is: the shader computes batch 0 only
    "batched": ({"q8ta_linear": 1}, {"fc.bias", "_scale_0"}, False),
    # the bias (and scales) one linear pads in place are read by another linear: tracing it fails
    "shared": None,
    "shared_declined": None,
    # linear_q8ta_q8csw's reference (its meta) adds the padded bias unsliced: tracing it fails
    "float_out": None,
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_on_the_same_models(name: str) -> None:
    ep, x = _edge(name)
    original = copy.deepcopy(ep)
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    want = UPSTREAM[name]
    if want is None:
        with pytest.raises(Exception, match="FusePatternsPass"):
            _upstream(ep)
        return
    kernels, padded, right = want
    theirs = _upstream(ep)
    assert _et_vk(theirs) == Counter(kernels)
    changed = {k for k, v in before.items() if k in theirs.state_dict and v.shape != theirs.state_dict[k].shape}
    assert changed == padded
    errors = [(a - b).abs().max().item() / step for a, b, step in
              zip(_outputs(original.module()(*x)), _oracle(theirs, x), _steps(original), strict=True)]  # fmt: skip
    assert (max(errors) <= 1.001) == right, errors


def _delegated(ep: ExportedProgram) -> tuple[int, int]:
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    delegates = sum("executorch_call_delegate" in str(n.target) for n in calls)
    products = sum(any(op in str(n.target) for op in ("addmm", "aten.mm", "et_vk")) for n in calls)
    return delegates, products


# (delegates, linears left outside them) of upstream's lowering, as measured; None: it raises
UPSTREAM_LOWERING: dict[str, tuple[int, int] | None] = {
    "linear": (1, 0),
    "chain": (1, 0),
    "3d": (1, 0),
    "batched": (1, 0),  # (rewritten to a q8ta_linear of the (2, 3, 8) input: batch 1 never computed)
    "shared": None,
    "shared_declined": None,
    "float_out": None,
    "float_out_3d": (1, 0),
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_LOWERING))
def test_the_rewritten_program_lowers_through_vulkan_and_serialises(name: str) -> None:
    program, _ = _pt2e(name)
    manager = to_edge(program)
    adapters.transform(manager.exported_program(), list(RULES)).unwrap()
    lowered = manager.to_backend(VulkanPartitioner())
    delegates, left = _delegated(lowered.exported_program())
    if name.startswith("float_out"):
        # the partitioner's op_registry declares every input of linear_q8ta_q8csw float (FP_T), the
        # int8 weight too: a program holding it before partitioning keeps it outside the delegate,
        # where it has no kernel (upstream writes it only inside, after partitioning)
        assert left == 1
        with pytest.raises(RuntimeError, match=r"Missing out variants.*linear_q8ta_q8csw"):
            lowered.to_executorch()
    else:
        assert delegates >= 1 and left == 0  # every linear in the delegate
        assert len(lowered.to_executorch().buffer) > 0
    # upstream's own lowering of the untransformed program (its pass runs inside the partitioner)
    want = UPSTREAM_LOWERING[name]
    if want is None:  # its pass pads a bias in place; a reader of the padded bias then fails to trace
        with pytest.raises(Exception, match="FusePatternsPass"):
            to_edge_transform_and_lower(_pt2e(name)[0], partitioner=[VulkanPartitioner()])
        return
    theirs = to_edge_transform_and_lower(_pt2e(name)[0], partitioner=[VulkanPartitioner()])
    assert _delegated(theirs.exported_program()) == want
