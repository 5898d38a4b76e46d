"""Quantized edge programs, upstream's Vulkan conv packing, and an exact int8 oracle for packed programs
(``tests/q8ta_oracle.py``: what the Vulkan kernels compute from the packed arguments alone)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
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

from fxpure.plan import RewriteReport
from tests import q8ta_oracle

qd = torch.ops.quantized_decomposed


def pt2e(
    model: nn.Module,
    x: tuple[torch.Tensor, ...],
    *,
    per_channel: bool = True,
    dynamic: Any = None,
    dynamic_quant: bool = False,
) -> ExportedProgram:
    """PT2E with ``XNNPACKQuantizer`` (symmetric int8; ``dynamic_quant``: activations quantized at
    run time, ``choose_qparams``), exported again: an aten program."""
    converted = pt2e_module(model, x, per_channel=per_channel, dynamic=dynamic, dynamic_quant=dynamic_quant)
    return torch.export.export(converted, x, dynamic_shapes=dynamic)


def pt2e_module(
    model: nn.Module,
    x: tuple[torch.Tensor, ...],
    *,
    per_channel: bool = True,
    dynamic: Any = None,
    dynamic_quant: bool = False,
) -> torch.fx.GraphModule:
    """The GraphModule ``convert_pt2e`` returns (its constants ``get_attr`` nodes)."""
    gm = torch.export.export(copy.deepcopy(model).eval(), x, dynamic_shapes=dynamic).module()
    config = get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=dynamic_quant)
    quantizer = XNNPACKQuantizer().set_global(config)
    prepared = prepare_pt2e(gm, quantizer)
    prepared(*x)
    converted: torch.fx.GraphModule = convert_pt2e(prepared)
    return converted


def register_int8_weight(module: nn.Module, w: torch.Tensor) -> None:
    """Buffers ``scale``, ``zp`` and ``wq`` on ``module``: ``w`` quantized per output channel to
    symmetric int8 ([-127, 127]), as a hand-written PT2E-shaped model holds its weight."""
    scale = w.abs().amax(dim=tuple(range(1, w.dim()))) / 127
    zp = torch.zeros(w.shape[0], dtype=torch.int64)
    module.register_buffer("scale", scale)
    module.register_buffer("zp", zp)
    module.register_buffer("wq", qd.quantize_per_channel(w, scale, zp, 0, -127, 127, torch.int8))


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


@dataclass(frozen=True)
class _Chain:
    """A q8ta node of the rewritten program and the chain it stands for in the original."""

    node: str  # the q8ta node
    xq: str  # the chain's int8 input (what its dequantize reads)
    quantized: str  # the float value its quantize reads: the conv's output, or its ReLU's
    q: str  # the quantize: the chain's int8 output


def _chains(ep: ExportedProgram, original: ExportedProgram, report: RewriteReport) -> list[_Chain]:
    """Each q8ta node with its chain, found by walking the original graph from the conv it replaced."""
    provenance = {n.name: n.provenance for n in report.after.nodes if "q8ta" in n.target}
    nodes = {n.name: n for n in original.graph.nodes}
    out = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or "q8ta" not in str(n.target):
            continue
        source = provenance.get(n.name)
        assert source is not None, f"{n.name}: no provenance"
        conv = nodes[source]
        dq = conv.args[0]
        assert isinstance(dq, torch.fx.Node) and "dequantize_per_tensor" in str(dq.target), conv.name
        xq = dq.args[0]
        assert isinstance(xq, torch.fx.Node)
        quantized = conv
        if len(conv.users) == 1 and "relu" in str(next(iter(conv.users)).target):
            quantized = next(iter(conv.users))
        # an edge op prints as quantized_decomposed::quantize_per_tensor..., an aten one with a dot
        (q,) = [u for u in quantized.users if re.split("::|[.]", str(u.target))[1:2] == ["quantize_per_tensor"]]
        out.append(_Chain(node=n.name, xq=xq.name, quantized=quantized.name, q=q.name))
    return out


class _Fed(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value (``computed``); a node named in ``feed`` passes that
    value on instead (``fed``)."""

    def __init__(self, gm: torch.fx.GraphModule, feed: dict[str, torch.Tensor]) -> None:
        super().__init__(gm)
        self.feed = feed
        self.computed: dict[str, Any] = {}
        self.fed: dict[str, Any] = {}
        self.node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        value = super().run_node(n)
        self.computed[n.name] = value
        value = self.feed.get(n.name, value)
        self.fed[n.name] = value
        return value


class _Kernels(_Fed):
    """Runs the rewritten program with each q8ta node checked against the original chain: the kernel
    reads the chain's int8 input, computes (``q8ta_oracle``) the chain's int8 output up to rounding
    ties, and passes the chain's own output on, so ties do not spread and the outputs must be equal."""

    def __init__(self, ep: ExportedProgram, reference: _Fed, chains: list[_Chain]) -> None:
        names = {c.q for c in chains}
        super().__init__(ep.graph_module, {k: v for k, v in reference.feed.items() if k not in names})
        self.reference, self.chains = reference, {c.node: c for c in chains}
        self.ties = self.checked = 0

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if "q8ta" not in str(target):
            return super().call_function(target, args, kwargs)
        assert self.node is not None and not kwargs
        chain, ref = self.chains[self.node.name], self.reference
        x = args[0]
        assert isinstance(x, torch.Tensor) and torch.equal(x, ref.fed[chain.xq]), f"{chain.node}: not the chain's input"
        call = q8ta_oracle.parse(str(target), args)
        got = q8ta_oracle.run(call, x, out_channels=int(self.node.meta["val"].shape[1]))
        want, want_float = ref.computed[chain.q], ref.computed[chain.quantized]
        self.ties += q8ta_oracle.assert_matches(got, want, want_float, call.output_scale, chain.node)
        self.checked += 1
        return ref.fed[chain.q]


def _run(fed: _Fed, ep: ExportedProgram, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = fed.run(*lifted_args(ep, x))
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    assert all(isinstance(t, torch.Tensor) for t in flat)
    return flat


def assert_exact(
    ep: ExportedProgram, original: ExportedProgram, report: RewriteReport, x: tuple[torch.Tensor, ...]
) -> int:
    """Each q8ta node, computed as the Vulkan kernel computes it from its packed arguments alone
    (``tests/q8ta_oracle.py``), gives the original chain's int8 output on the program's own inputs and
    on random int8 inputs to every chain, bit for bit but for rounding ties (``assert_matches``); with
    each chain's output passed on, the rewritten program's outputs equal the original's. Returns the ties."""
    chains = _chains(ep, original, report)
    assert len(chains) == len(report.plans) > 0
    ties = 0
    shapes: dict[str, torch.Size] = {}
    for seed in (None, 0, 1):
        feed: dict[str, torch.Tensor] = {}
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            feed = {k: torch.randint(-128, 128, s, generator=g, dtype=torch.int8) for k, s in shapes.items()}
        reference = _Fed(original.graph_module, feed)
        want = _run(reference, original, x)
        shapes = shapes or {c.xq: reference.computed[c.xq].shape for c in chains}
        kernels = _Kernels(ep, reference, chains)
        got = _run(kernels, ep, x)
        assert kernels.checked == len(chains)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        ties += kernels.ties
    return ties
