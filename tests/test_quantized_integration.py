"""quantized_conv on PT2E-quantized edge programs: upstream-identical packing, exact inverse-plan
numerics, typed declines where upstream is wrong, shared weights, and lowering to Vulkan."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
from executorch.exir import to_edge
from returns.result import Success
from torch import nn
from torch.export import ExportedProgram
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import adapters
from adapters.passes import QuantizedConvolutionPass
from adapters.snap import capture
from fxpure.plan import RewriteReport
from fxpure.rules import quantized_conv
from tests import q8ta_oracle
from tests.models import Q_MODELS, randomize_bn
from tests.programs import count, dead_constants, validate
from tests.quantized import assert_exact, pt2e, q8ta_calls, quantize, register_int8_weight, same_call, upstream_pack


def model_and_input(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    cls, shape = Q_MODELS[name]
    torch.manual_seed(0)
    return randomize_bn(cls()), (torch.randn(shape, generator=torch.Generator().manual_seed(1)),)


def kernels(ep: ExportedProgram) -> Counter[str]:
    return Counter(str(n.target).split(".")[-2] for n in ep.graph.nodes if "q8ta" in str(n.target))


def codes(report: RewriteReport) -> list[str]:
    return sorted(r.reason.code for r in report.rejections)


EXPECTED: dict[str, tuple[dict[str, int], list[str]]] = {
    "mobilenet": ({"q8ta_conv2d": 2, "q8ta_conv2d_dw": 2, "q8ta_conv2d_pw": 2}, []),
    "resnet": ({"q8ta_conv2d": 7}, []),
    "transposed": ({"q8ta_conv2d_transposed": 2, "q8ta_conv2d": 1}, []),
    "grouped": ({"q8ta_conv2d": 2}, ["channel-alignment"]),
    "odd_depthwise": ({"q8ta_conv2d_pw": 2}, ["channel-alignment"]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_kernels_declines_and_exact_numerics(name: str) -> None:
    model, x = model_and_input(name)
    ep = quantize(model, x).exported_program()
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    want_kernels, want_codes = EXPECTED[name]
    assert kernels(ep) == Counter(want_kernels)
    assert codes(report) == want_codes
    assert count(ep, "dequantize_per_channel") == len(want_codes)  # only declined convs keep theirs
    assert dead_constants(ep) == []
    validate(ep)
    assert_exact(ep, original, report, x)


@pytest.mark.parametrize("name", ["mobilenet", "resnet", "transposed"])
def test_packing_is_bit_identical_to_upstream(name: str) -> None:
    model, x = model_and_input(name)
    ep = quantize(model, x).exported_program()
    theirs = copy.deepcopy(ep)
    assert upstream_pack(theirs) == sum(EXPECTED[name][0].values())
    adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap()
    ours, upstream = q8ta_calls(ep), q8ta_calls(theirs)
    assert len(ours) == len(upstream) > 0
    for a, b in zip(ours, upstream, strict=True):
        assert same_call(a, b), f"{a[0]} differs from upstream"
    assert dead_constants(theirs) != []  # upstream leaves the weight zero points behind; fxpure does not
    assert {n.meta["val"].dtype for n in theirs.graph.nodes if "q8ta" in str(n.target)} == {torch.float32}
    assert {n.meta["val"].dtype for n in ep.graph.nodes if "q8ta" in str(n.target)} == {torch.int8}


def test_grouped_pointwise_takes_the_general_kernel() -> None:
    model, x = model_and_input("grouped")
    ep = quantize(model, x).exported_program()
    theirs = copy.deepcopy(ep)
    upstream_pack(theirs)
    assert "q8ta_conv2d_pw" in kernels(theirs)  # upstream: a kernel that ignores groups
    adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap()
    grouped_1x1 = [n for n in ep.graph.nodes if "q8ta" in str(n.target) and n.args[9] == [1, 1]]
    assert len(grouped_1x1) == 1 and "q8ta_conv2d.default" in str(grouped_1x1[0].target)
    assert grouped_1x1[0].args[-2] == 2
    (ours_3x3, ours_1x1), (theirs_3x3, theirs_1x1) = q8ta_calls(ep), q8ta_calls(theirs)
    assert same_call(ours_3x3, theirs_3x3)  # grouped 3x3: identical to upstream
    assert same_call(("op", ours_1x1[1]), ("op", theirs_1x1[1]))  # same packing, only the kernel differs


def test_odd_depthwise_declined_where_upstream_asserts() -> None:
    model, x = model_and_input("odd_depthwise")
    ep = quantize(model, x).exported_program()
    with pytest.raises(AssertionError, match="divisible by 4"):
        upstream_pack(copy.deepcopy(ep))
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    (rejection,) = report.rejections
    assert rejection.reason.message.endswith("depthwise output channels is 6, not a multiple of 4")


def test_asymmetric_weight_declined() -> None:
    model, x = model_and_input("twin")
    ep = quantize(model, x).exported_program()
    zero_points = sorted(k for k in ep.state_dict if "zero_point" in k)
    ep.state_dict[zero_points[0]][0] = 3
    original = copy.deepcopy(ep)
    assert upstream_pack(copy.deepcopy(ep)) == 2  # upstream packs it as if symmetric
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert codes(report) == ["asymmetric-weight"] and len(report.plans) == 1
    assert_exact(ep, original, report, x)


def _share_weight(ep: ExportedProgram) -> None:
    """Make the second conv's weight dequantize read the first conv's int8 weight."""
    dq = [n for n in ep.graph.nodes if "dequantize_per_channel" in str(n.target)]
    first, second = dq[0].args[0], dq[1].args[0]
    dq[1].replace_input_with(second, first)
    ep.graph.erase_node(second)
    spec = next(s for s in ep.graph_signature.input_specs if s.arg.name == second.name)
    ep.graph_signature.input_specs.remove(spec)
    assert spec.target is not None
    del ep.state_dict[spec.target]
    ep.graph_module.recompile()


def test_shared_weight_packed_once() -> None:
    model, x = model_and_input("twin")
    ep = quantize(model, x).exported_program()
    _share_weight(ep)
    original = copy.deepcopy(ep)
    # upstream packs the weight, then cannot unpack it (now 2-d) for the second conv
    with pytest.raises(ValueError, match=r"not enough values to unpack \(expected 4, got 2\)"):
        upstream_pack(copy.deepcopy(ep))
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert len(report.plans) == 2
    packed = [s.target for s in ep.graph_signature.input_specs if s.target and s.target.endswith("_packed")]
    assert len(packed) == 1
    assert dead_constants(ep) == []
    assert_exact(ep, original, report, x)


def test_per_tensor_weights() -> None:
    model, x = model_and_input("mobilenet")
    ep = quantize(model, x, per_channel=False).exported_program()
    original = copy.deepcopy(ep)
    with pytest.raises(AssertionError) as info:  # upstream's detector expects a scales tensor
        upstream_pack(copy.deepcopy(ep))
    assert info.value.args == ()  # a bare assert, no message
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert codes(report) == [] and len(report.plans) == 6
    assert_exact(ep, original, report, x)


def test_dynamic_batch() -> None:
    model, one = model_and_input("mobilenet")
    x = (torch.cat([one[0], -one[0]]),)  # batch 2: a batch of 1 would be specialised
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = quantize(model, x, dynamic=({0: batch},)).exported_program()
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert len(report.plans) == 6
    node = next(n for n in ep.graph.nodes if "q8ta" in str(n.target))
    assert not isinstance(node.meta["val"].shape[0], int) and node.meta["val"].dtype == torch.int8
    x3 = (torch.randn(3, *x[0].shape[1:]),)
    assert_exact(ep, original, report, x3)


def test_pass_in_edge_manager_then_vulkan_and_executorch() -> None:
    model, x = model_and_input("mobilenet")
    manager = quantize(model, x)
    ep = manager.exported_program()
    manager = manager.transform([QuantizedConvolutionPass(ep, fallback="none")])
    assert kernels(manager.exported_program()) == Counter(EXPECTED["mobilenet"][0])
    assert dead_constants(manager.exported_program()) == []
    pte = manager.to_backend(VulkanPartitioner()).to_executorch()
    assert len(pte.buffer) > 0


class InPlaceRelu(torch.nn.Module):
    """A conv, a ``ReLU(inplace=True)`` (an aten program keeps ``relu_``), a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.relu, self.c2 = (
            torch.nn.Conv2d(4, 8, 3, padding=1),
            torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(8, 8, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c2(self.relu(self.c1(x)))
        return out


def test_a_relu_in_place_packs_with_its_conv_in_the_aten_program() -> None:
    # its quantize reads the relu_, which writes the conv's output: it packs as a relu does
    torch.manual_seed(0)
    x = (torch.randn(1, 4, 8, 8),)
    ep = pt2e(InPlaceRelu().eval(), x)
    assert count(ep, "relu_") == 1
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert kernels(ep) == Counter({"q8ta_conv2d": 1, "q8ta_conv2d_pw": 1}) and codes(report) == []
    assert count(ep, "relu") == 0 and count(ep, "aten.conv2d") == 0
    assert [call[1][-1] for call in q8ta_calls(ep)] == ["relu", "none"]
    assert dead_constants(ep) == []
    validate(ep)
    assert_exact(ep, original, report, x)


def test_a_channels_last_input_still_packs() -> None:
    # the q8ta ops run only in the Vulkan delegate: the dim-order check of the portable kernels does
    # not apply to them (a review found every such conv declined dim-order-changes)
    model, one = model_and_input("mobilenet")
    x = (one[0].to(memory_format=torch.channels_last),)
    ep = quantize(model, x).exported_program()
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert len(report.plans) == 6 and "dim-order-changes" not in codes(report)
    assert_exact(ep, original, report, x)


class NarrowOutput(torch.nn.Module):
    """dq(x) -> 1x1 conv(dq(int8 w)) -> q to [low, 127]: a range the q8ta kernels (which clamp to
    [-128, 127]) do not keep."""

    def __init__(self, low: int) -> None:
        super().__init__()
        register_int8_weight(self, torch.randn(8, 8, 1, 1))
        self.low = low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qd = torch.ops.quantized_decomposed
        xd = qd.dequantize_per_tensor(
            qd.quantize_per_tensor(x, 0.05, 0, -128, 127, torch.int8), 0.05, 0, -128, 127, torch.int8
        )
        w = qd.dequantize_per_channel(self.wq, self.scale, self.zp, 0, -127, 127, torch.int8)
        y = qd.quantize_per_tensor(torch.nn.functional.conv2d(xd, w), 0.01, 0, self.low, 127, torch.int8)
        return qd.dequantize_per_tensor(y, 0.01, 0, self.low, 127, torch.int8)  # type: ignore[no-any-return]


@pytest.mark.parametrize("low", [-127, 0])
def test_an_output_quantized_to_a_narrower_range_than_the_kernels_is_not_packed(low: int) -> None:
    # packed, the values the program clamps to `low` came out down to -128 (128 steps off for [0, 127])
    torch.manual_seed(0)
    model, x = NarrowOutput(low).eval(), (torch.randn(1, 8, 4, 4) * 3,)
    want = model(*x)
    ep = torch.export.export(model, x)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    (r,) = report.rejections
    assert r.reason.code == "no-kernel" and f"quantized to [{low}, 127]" in r.reason.message
    outcome = adapters.transform(ep, [quantized_conv()]).unwrap()  # the float fallback keeps the range
    assert q8ta_calls(ep) == [] and outcome.changed
    assert torch.equal(ep.module()(*x), want) and want.min() == low * 0.01
    # upstream packs it (its pattern reads no range): what the kernel stores goes below `low`
    edge = to_edge(torch.export.export(model, x)).exported_program()
    assert upstream_pack(edge) == 1
    ((target, args),) = q8ta_calls(edge)
    xq = torch.ops.quantized_decomposed.quantize_per_tensor(x[0], 0.05, 0, -128, 127, torch.int8)
    stored = q8ta_oracle.run(q8ta_oracle.parse(target, args), xq, out_channels=8).q
    assert stored.min() < low


def test_the_graph_module_convert_pt2e_returns_is_planned_as_its_export_is() -> None:
    # convert_pt2e adds its quantize and dequantize nodes without meta["val"]: the conv had no known
    # input shape (its float fallback, instead of malformed-node) and the linear was declined
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from fxpure.rules import linear_to_conv2d

    model = torch.nn.Sequential(
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 64, 10)
    ).eval()
    x = (torch.randn(1, 8, 8, 8),)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(torch.export.export(model, x).module(), quantizer)
    prepared(*x)
    gm = convert_pt2e(prepared)
    report = adapters.transform(copy.deepcopy(gm), [quantized_conv()], dry_run=True).unwrap().report
    assert [(p.anchor, p.instead_of) for p in report.plans] == [("conv2d", None)] and report.rejections == ()
    # nodes added after convert_pt2e without meta["val"], reading a weight's dequantize and an
    # activation: one fake mode for both (a fresh one for the weight's made transform raise)
    mixed = copy.deepcopy(gm)
    dq = next(n for n in mixed.graph.nodes if n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default)
    conv = next(iter(dq.users))
    with mixed.graph.inserting_after(conv):
        total = mixed.graph.call_function(torch.ops.aten.sum.default, (dq,))
    with mixed.graph.inserting_after(total):
        shifted = mixed.graph.call_function(torch.ops.aten.add.Tensor, (conv, total))
    conv.replace_all_uses_with(shifted, delete_user_cb=lambda u: u is not shifted)
    mixed.recompile()
    assert capture(mixed).node(shifted.name).spec == capture(gm).node(conv.name).spec
    assert isinstance(adapters.transform(mixed, [quantized_conv()], dry_run=True), Success)
    want = gm(*x)
    outcome = adapters.transform(gm, [linear_to_conv2d()]).unwrap()
    assert [p.anchor for p in outcome.report.plans] == ["linear"] and outcome.changed
    assert torch.allclose(gm(*x), want, atol=1e-6)


@pytest.mark.parametrize("kernel", [3, 1])
def test_a_conv_of_one_channel_in_and_out_is_packed_for_the_general_kernel(kernel: int) -> None:
    # it was taken for a depthwise conv (one input channel per group, as many groups as outputs)
    # and declined "depthwise output channels is 1, not a multiple of 4": float, where it packs
    torch.manual_seed(0)
    x = (torch.randn(1, 1, 8, 8),)
    ep = quantize(torch.nn.Conv2d(1, 1, kernel, padding=kernel // 2).eval(), x).exported_program()
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert report.rejections == () and len(report.plans) == 1
    assert kernels(ep) == Counter({"q8ta_conv2d_pw" if kernel == 1 else "q8ta_conv2d": 1})
    assert_exact(ep, original, report, x)


class TensorParams(torch.nn.Module):
    """``dq(x) -> conv(dq(int8 w)) -> q`` with the per-tensor parameters of the activations (or of
    the weight) given as 0-d tensors: ``quantize_per_tensor.tensor``, ``dequantize_per_tensor.tensor``."""

    def __init__(self, weight: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = weight
        self.register_buffer("wq", torch.randint(-127, 128, (8, 4, 3, 3), generator=g, dtype=torch.int8))
        self.register_buffer("scales", torch.rand(8, generator=g) * 0.01 + 0.001)
        self.register_buffer("zeros", torch.zeros(8, dtype=torch.int64))
        for name, value in (("ws", 0.01), ("wz", 0), ("xs", 0.02), ("xz", 1), ("os", 0.05), ("oz", -2)):
            self.register_buffer(name, torch.tensor(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qd = torch.ops.quantized_decomposed
        params: tuple[Any, ...]
        if self.weight:  # the activations' as numbers, the weight's as tensors
            q, dq, params = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default, (0.02, 1, 0.05, -2)
            w = qd.dequantize_per_tensor.tensor(self.wq, self.ws, self.wz, -127, 127, torch.int8)
        else:
            q, dq = qd.quantize_per_tensor.tensor, qd.dequantize_per_tensor.tensor
            params = tuple(getattr(self, name) for name in ("xs", "xz", "os", "oz"))
            w = qd.dequantize_per_channel(self.wq, self.scales, self.zeros, 0, -127, 127, torch.int8)
        xs, xz, os, oz = params
        xd = dq(q(x, xs, xz, -128, 127, torch.int8), xs, xz, -128, 127, torch.int8)
        y = q(torch.nn.functional.conv2d(xd, w, None, padding=1), os, oz, -128, 127, torch.int8)
        out: torch.Tensor = dq(y, os, oz, -128, 127, torch.int8)
        return out


@pytest.mark.parametrize("weight", [False, True], ids=["activations", "weight"])
@pytest.mark.parametrize("form", ["aten", "edge"])
def test_parameters_given_as_tensors_are_declined_and_the_conv_runs_in_float(form: str, weight: bool) -> None:
    # found by a hunt: the .tensor overloads were no dequantize to fxpure: declined not-quantized
    # ("... comes from dequantize_per_tensor, not a dequantize"), the fallback not applied either,
    # and Vulkan's partitioner then failed on the conv. The kernels take the parameters as numbers,
    # which a 0-d tensor's are not when planning: not-scalar, and the weight dequantized
    x = (torch.randn(1, 4, 8, 8),)
    edge = to_edge(torch.export.export(TensorParams(weight).eval(), x)) if form == "edge" else None
    ep = edge.exported_program() if edge is not None else torch.export.export(TensorParams(weight).eval(), x)
    want = ep.module()(*x)
    report = adapters.transform(ep, [quantized_conv()]).unwrap().report
    assert report.rejections == () and [(p.instead_of and p.instead_of.code) for p in report.plans] == ["not-scalar"]
    path = report.plans[0].instead_of.path if report.plans[0].instead_of else ""
    assert path == ("conv.weight/dqw.scale" if weight else "conv.input/dqx.scale")
    assert count(ep, "dequantize_per_channel") == 0 and count(ep, "dequantize_per_tensor") == 2  # the weight's gone
    assert torch.equal(ep.module()(*x), want)
    if edge is not None:  # the float conv lowers through the Vulkan partitioner
        assert len(edge.to_backend(VulkanPartitioner()).to_executorch().buffer) > 0


@pytest.mark.parametrize("form", ["aten", "edge"])
def test_a_dynamically_quantized_conv_keeps_its_int8_weight(form: str) -> None:
    # found by a review: once the .tensor overloads were a dequantize, the fallback matched a conv
    # quantized at run time (choose_qparams, XNNPACK's dynamic quantization) and gave it a float
    # weight: the numbers were the same, the int8 weight and the .pte's dynamically quantized conv lost
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3)).eval(), (torch.randn(1, 8, 10, 10),)
    ep = pt2e(model, x, dynamic_quant=True)
    program = ep if form == "aten" else to_edge(ep).exported_program()
    want = program.module()(*x)
    report = adapters.transform(program, [quantized_conv()]).unwrap().report
    assert report.plans == () and [r.reason.code for r in report.rejections] == ["not-scalar"]
    assert count(program, "dequantize_per_channel") == 1 and torch.equal(program.module()(*x), want)


class _Head(torch.nn.Module):
    """Float convs, then a linear head: quantizing the head only leaves the convs float."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.Sequential(*[torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(3)])
        self.head = torch.nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.convs(x).mean((2, 3)))
        return out


@pytest.mark.parametrize("how", ["head-only", "reference"])
def test_a_float_conv_of_a_quantized_program_is_no_candidate_a_reference_quantized_one_is(how: str) -> None:
    # found by a review: quantizing a model's linear head only made each of its float convs declined
    # not-quantized again (noise); convert_pt2e's reference representation, which dequantizes by
    # arithmetic (no dequantize op), had every conv dropped from the report (neither planned nor declined)
    model, x = _Head().eval(), (torch.randn(1, 4, 8, 8),)
    gm = torch.export.export(model, x).module()
    config = get_symmetric_quantization_config(is_per_channel=True)
    quantizer = XNNPACKQuantizer()
    quantizer = (
        quantizer.set_module_type(torch.nn.Linear, config) if how == "head-only" else quantizer.set_global(config)
    )
    prepared = prepare_pt2e(gm, quantizer)
    prepared(*x)
    program = torch.export.export(convert_pt2e(prepared, use_reference_representation=how == "reference"), x)
    report = adapters.transform(program, [quantized_conv()], dry_run=True).unwrap().report
    convs = [n.name for n in program.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert len(convs) == 3 and report.plans == ()
    declined = [(r.node, r.reason.code) for r in report.rejections]
    assert declined == ([] if how == "head-only" else [(c, "not-quantized") for c in convs])


class Same(nn.Module):
    """A conv with ``padding="same"`` (a ``k`` by ``k`` kernel, dilation ``d``), then a 1x1 one with
    ``padding="valid"``: an aten program keeps the strings."""

    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 8, k, padding="same", dilation=d)
        self.pw = nn.Conv2d(8, 8, 1, padding="valid")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pw(torch.relu(self.c(x)))
        return out


@pytest.mark.parametrize(("k", "d", "packed"), [(3, 1, True), (3, 2, True), (4, 2, True), (4, 1, False)])
def test_padding_same_or_valid_packs_in_the_aten_program_as_on_edge(k: int, d: int, packed: bool) -> None:
    # found by a hunt: the aten program's padding strings were declined no-kernel, where edge (numbers) packed;
    # 'same' of an even dilated kernel pads one side more, which the kernels cannot
    torch.manual_seed(0)
    x = (torch.randn(1, 4, 8, 8),)
    ep = pt2e(Same(k, d).eval(), x)
    original = copy.deepcopy(ep)
    report = adapters.transform(ep, [quantized_conv(fallback="none")]).unwrap().report
    assert kernels(ep) == Counter({"q8ta_conv2d": 1, "q8ta_conv2d_pw": 1} if packed else {"q8ta_conv2d_pw": 1})
    assert codes(report) == ([] if packed else ["no-kernel"])
    validate(ep)
    assert_exact(ep, original, report, x)
