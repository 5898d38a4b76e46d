"""Quantized edge programs, upstream's Vulkan conv packing, and an exact oracle for packed programs."""

from __future__ import annotations

import copy
from typing import Any

import torch
from executorch.backends.vulkan.patterns.quantized_convolution import (
    find_quantized_convolution_patterns,
    make_q8ta_conv2d_custom_op,
)
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from executorch.exir import EdgeProgramManager, to_edge
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from adapters.weights import materialize
from fxpure.plan import RewriteReport
from fxpure.weights import Source, unpack

qd = torch.ops.quantized_decomposed


def pt2e(
    model: nn.Module, x: tuple[torch.Tensor, ...], *, per_channel: bool = True, dynamic: Any = None
) -> ExportedProgram:
    """PT2E with ``XNNPACKQuantizer`` (symmetric int8), exported again: an aten program."""
    gm = torch.export.export(copy.deepcopy(model).eval(), x, dynamic_shapes=dynamic).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=per_channel))
    prepared = prepare_pt2e(gm, quantizer)
    prepared(*x)
    return torch.export.export(convert_pt2e(prepared), x, dynamic_shapes=dynamic)


def quantize(
    model: nn.Module, x: tuple[torch.Tensor, ...], *, per_channel: bool = True, dynamic: Any = None
) -> EdgeProgramManager:
    """``pt2e``, then ``to_edge``."""
    return to_edge(pt2e(model, x, per_channel=per_channel, dynamic=dynamic))


def upstream_pack(ep: ExportedProgram) -> int:
    """ExecuTorch's Vulkan detector + replacement for quantized convs, as FusePatternsPass runs them."""
    gm = ep.graph_module
    replaced = 0
    for node in list(gm.graph.nodes):
        match = find_quantized_convolution_patterns(node)
        if match is not None:
            make_q8ta_conv2d_custom_op(ep, gm, match)
            replaced += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return replaced


def tensor(ep: ExportedProgram, node: torch.fx.Node) -> torch.Tensor:
    """The constant behind a lifted placeholder."""
    (spec,) = [s for s in ep.graph_signature.input_specs if getattr(s.arg, "name", None) == node.name]
    assert spec.target is not None and spec.kind != InputKind.USER_INPUT
    t = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
    assert isinstance(t, torch.Tensor)
    return t


def q8ta_calls(ep: ExportedProgram) -> list[tuple[str, list[Any]]]:
    """Each q8ta node in order: its op and its arguments, constants resolved to tensors."""
    consts = {s.arg.name for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT}
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or "q8ta" not in str(n.target):
            continue
        args = [tensor(ep, a) if isinstance(a, torch.fx.Node) and a.name in consts else a for a in n.args]
        out.append((str(n.target), args))
    return out


def same_call(a: tuple[str, list[Any]], b: tuple[str, list[Any]]) -> bool:
    """Same op and bit-identical arguments (tensors: dtype, shape and every bit)."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1], strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
        if isinstance(x, torch.fx.Node) and (not isinstance(y, torch.fx.Node) or str(x.target) != str(y.target)):
            return False
        if not isinstance(x, (torch.Tensor, torch.fx.Node)) and x != y:
            return False
    return True


def lifted_args(ep: ExportedProgram, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Arguments of ``ep.graph_module``: the lifted constants in signature order, then the inputs."""
    user = iter(x)
    out = []
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.USER_INPUT:
            out.append(next(user))
            continue
        t = ep.state_dict.get(s.target, ep.constants.get(s.target)) if s.target is not None else None
        assert isinstance(t, torch.Tensor)
        out.append(t)
    return out


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value by name."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n.name] = value
        return value


def values(ep: ExportedProgram, x: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every node's value when ``ep`` runs on ``x``."""
    rec = _Recorder(ep.graph_module)
    with torch.no_grad():
        rec.run(*lifted_args(ep, x))
    return rec.values


class _Unpacked(_Recorder):
    """Evaluates q8ta nodes as dequantize -> conv -> [relu] -> quantize with the weights, scales and
    bias recovered from the packed constants through the plans' inverses (never the Vulkan kernels)."""

    def __init__(self, ep: ExportedProgram, report: RewriteReport) -> None:
        super().__init__(ep.graph_module)
        self.ep, self.report = ep, report

    def unpacked(self, node: torch.fx.Node) -> torch.Tensor:
        info = self.report.after.constants[node.name]
        packed = tensor(self.ep, node)
        if info.source is None:
            return packed
        _, back = unpack(info.source, Source(key=node.name, spec=info.spec)).unwrap()
        return materialize(back, {node.name: packed})

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if "q8ta" not in str(target):
            return super().call_function(target, args, kwargs)
        node = self.current
        x, s_in, z_in, _, _, _, s_out, z_out, _, _, stride, padding, *rest = args
        transposed = "transposed" in str(target)
        out_pad = rest.pop(0) if transposed else [0, 0]
        dilation, groups, activation = rest
        w_node, scales_node, bias_node = node.args[3], node.args[5], node.args[8]
        assert isinstance(w_node, torch.fx.Node) and isinstance(scales_node, torch.fx.Node)
        w, scales = self.unpacked(w_node), self.unpacked(scales_node)
        bias = self.unpacked(bias_node) if isinstance(bias_node, torch.fx.Node) else None
        axis = 1 if transposed else 0
        xf = qd.dequantize_per_tensor(x, s_in, z_in, -128, 127, torch.int8)
        zeros = torch.zeros(w.shape[axis], dtype=torch.int64)
        wf = qd.dequantize_per_channel(w, scales[: w.shape[axis]], zeros, axis, -127, 127, torch.int8)
        y = torch.ops.aten.convolution(xf, wf, bias, stride, padding, dilation, transposed, out_pad, groups)
        if activation == "relu":
            y = torch.relu(y)
        return qd.quantize_per_tensor(y, s_out, z_out, -128, 127, torch.int8)

    @property
    def current(self) -> torch.fx.Node:
        return self._current

    def run_node(self, n: torch.fx.Node) -> Any:
        self._current = n
        return super().run_node(n)


def unpacked_values(ep: ExportedProgram, report: RewriteReport, x: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every node's value, q8ta nodes computed from the inverse plans of their packed constants."""
    rec = _Unpacked(ep, report)
    with torch.no_grad():
        rec.run(*lifted_args(ep, x))
    return rec.values


def assert_exact(
    ep: ExportedProgram, original: ExportedProgram, report: RewriteReport, x: tuple[torch.Tensor, ...]
) -> None:
    """Each q8ta node, evaluated from its unpacked weights, gives the original chain's int8 bits."""
    want, got = values(original, x), unpacked_values(ep, report, x)
    anchors = {p.anchor: p for p in report.plans}
    checked = 0
    for n in report.after.nodes:
        if "q8ta" not in n.target:
            continue
        assert n.provenance is not None
        quant = anchors[n.provenance].replace[0][0]
        assert got[n.name].dtype == torch.int8 and torch.equal(got[n.name], want[quant]), n.name
        checked += 1
    assert checked == len(report.plans) > 0
    (out,) = [n for n in ep.graph.nodes if n.op == "output"]
    (ref,) = [n for n in original.graph.nodes if n.op == "output"]
    for a, b in zip(got[out.name], want[ref.name], strict=True):
        assert torch.equal(a, b)
