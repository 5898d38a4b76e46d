"""The outside author's ``fold-bn-into-next-conv`` rule (``tests/fold_bn_into_conv.py``) on exported
programs: a batch norm before a conv without padding goes into the conv in every form (conv1d, 2d,
3d, grouped, depthwise, strided and dilated, bias or not, affine or not, float32/16/bf16), the
program computes what the model did, the program's own weights are never written (one shared by
another conv neither), a padded or transposed conv keeps its batch norm, and the edge program lowers
through XNNPACK and runs."""

from __future__ import annotations

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge
from torch import nn
from torch.export import ExportedProgram

import adapters
from adapters.passes import RulesPass
from tests.fold_bn_into_conv import fold_bn_into_conv
from tests.models import randomize_bn
from tests.programs import FORMS, assert_close, assert_sound, build, count, run, run_pte


class BnConv(nn.Module):
    """``conv(bn(x))`` for a conv (``transposed``: a transposed one) of ``rank`` spatial dims, then a relu."""

    def __init__(self, rank: int = 2, cin: int = 4, oc: int = 6, transposed: bool = False, **conv: object) -> None:
        super().__init__()
        bn_cls = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[rank - 1]
        convs = (
            (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
            if transposed
            else (nn.Conv1d, nn.Conv2d, nn.Conv3d)
        )
        conv_cls = convs[rank - 1]
        affine = bool(conv.pop("affine", True))
        self.bn = randomize_bn(bn_cls(cin, affine=affine), seed=rank)
        kernel = conv.pop("kernel_size", 3)
        self.conv = conv_cls(cin, oc, kernel, **conv)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(self.bn(x)))


def _x(rank: int = 2, cin: int = 4, size: int = 8) -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, cin, *(size,) * rank, generator=torch.Generator().manual_seed(1)),)


MODELS = {
    "conv2d": lambda: BnConv(),
    "conv1d": lambda: BnConv(rank=1, kernel_size=5),
    "conv3d": lambda: BnConv(rank=3, kernel_size=2),
    "grouped": lambda: BnConv(groups=2),
    "depthwise": lambda: BnConv(oc=8, groups=4),
    "depthwise-1d": lambda: BnConv(rank=1, oc=4, groups=4),
    "no-bias": lambda: BnConv(bias=False, groups=2),
    "no-affine": lambda: BnConv(affine=False),
    "strided-dilated": lambda: BnConv(stride=2, dilation=2),
    "valid": lambda: BnConv(padding="valid"),
    "same-1x1": lambda: BnConv(kernel_size=1, padding="same"),
    "transposed-cropped": lambda: BnConv(transposed=True, padding=2, groups=2),
    "transposed-1x1": lambda: BnConv(transposed=True, kernel_size=1, padding=1, bias=False),
    "transposed-1d-dilated": lambda: BnConv(rank=1, transposed=True, padding=4, dilation=2),
    "transposed-3d": lambda: BnConv(rank=3, transposed=True, kernel_size=2, padding=1, affine=False),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", MODELS)
def test_the_batch_norm_goes_into_the_conv_and_the_program_computes_what_the_model_did(form: str, name: str) -> None:
    model = MODELS[name]().eval()
    rank = {"conv1d": 1, "conv3d": 3, "depthwise-1d": 1, "transposed-1d-dilated": 1, "transposed-3d": 3}.get(name, 2)
    x = _x(rank)
    with torch.no_grad():
        want = [model(*x)]
    program = build(model, x, form)
    outcome = adapters.transform(program, [fold_bn_into_conv]).unwrap()
    assert len(outcome.report.plans) == 1 and not outcome.report.rejections
    assert count(program, "batch_norm") == 0 and count(program, "conv") == 1
    assert_sound(program, x, want)  # within 1e-5 of the model, no dead constant, validates
    # and the plan alone, on random inputs, by the adapter's own checker
    fresh = build(model, x, form)
    dry = adapters.transform(fresh, [fold_bn_into_conv], dry_run=True).unwrap()
    (checked,) = adapters.check_plans(fresh, dry.report)
    assert checked.ok, checked


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_folds_and_stays_in_its_dtype(dtype: torch.dtype, form: str) -> None:
    model = BnConv(groups=2).eval().to(dtype)
    x = tuple(t.to(dtype) for t in _x())
    with torch.no_grad():
        want = [model(*x)]
    program = build(model, x, form)
    outcome = adapters.transform(program, [fold_bn_into_conv]).unwrap()
    assert len(outcome.report.plans) == 1 and count(program, "batch_norm") == 0
    held = program.state_dict.values() if isinstance(program, ExportedProgram) else program.parameters()
    assert all(t.dtype == dtype for t in held if t.is_floating_point())
    assert_close(run(program, x), want, rel=2e-2)


class Declined(nn.Module):
    """What must keep its batch norm: a padded conv, a transposed conv whose edge outputs receive
    fewer taps, a strided one, a batch norm read twice, a ``padding="same"`` 3x3 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_pad, self.pad = randomize_bn(nn.BatchNorm2d(4), 1), nn.Conv2d(4, 4, 3, padding=1)
        self.bn_t, self.t = randomize_bn(nn.BatchNorm2d(4), 2), nn.ConvTranspose2d(4, 4, 3, padding=1)
        self.bn_s, self.s = randomize_bn(nn.BatchNorm2d(4), 6), nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.bn_two, self.two = randomize_bn(nn.BatchNorm2d(4), 3), nn.Conv2d(4, 4, 1)
        self.bn_same, self.same = randomize_bn(nn.BatchNorm2d(4), 4), nn.Conv2d(4, 4, 3, padding="same")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.bn_two(x)
        t, s = self.t(self.bn_t(x)), self.s(self.bn_s(x))
        return self.pad(self.bn_pad(x)), t, s, self.two(y) + y, self.same(self.bn_same(x))


@pytest.mark.parametrize("form", FORMS)
def test_padded_transposed_and_shared_batch_norms_stay_and_are_reported(form: str) -> None:
    model, x = Declined().eval(), _x()
    with torch.no_grad():
        want = list(model(*x))
    program = build(model, x, form)
    outcome = adapters.transform(program, [fold_bn_into_conv]).unwrap()
    assert not outcome.changed and not outcome.report.plans
    got = sorted((r.reason.code, r.reason.path) for r in outcome.report.rejections)
    assert got == [
        ("conv-padding", "conv.padding"),
        ("conv-padding", "conv.padding"),
        ("output-shared", "conv.input/bn"),
        ("transposed-conv", "conv.padding"),
        ("transposed-conv", "conv.stride"),
    ]
    assert count(program, "batch_norm") == 5
    assert_close(run(program, x), want)


class SharedWeight(nn.Module):
    """Two convs of one weight: one after a batch norm, one of the input itself."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = randomize_bn(nn.BatchNorm2d(4), 5)
        self.a, self.b = nn.Conv2d(4, 6, 3), nn.Conv2d(4, 6, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(self.bn(x)), self.b(x)


@pytest.mark.parametrize("form", FORMS)
def test_a_weight_another_conv_reads_too_is_never_written(form: str) -> None:
    model, x = SharedWeight().eval(), _x()
    before = model.a.weight.detach().clone()
    with torch.no_grad():
        want = list(model(*x))
    program = build(model, x, form)
    # (to_edge keeps one key of a tied weight, b's; a GraphModule, a's)
    if isinstance(program, ExportedProgram):
        held = program.state_dict["a.weight" if "a.weight" in program.state_dict else "b.weight"]
    else:
        held = program.get_parameter("a.weight")
    held_before = held.detach().clone()
    outcome = adapters.transform(program, [fold_bn_into_conv]).unwrap()
    assert len(outcome.report.plans) == 1
    assert torch.equal(held, held_before) and torch.equal(model.a.weight, before)
    assert count(program, "batch_norm") == 0 and count(program, "conv") == 2
    assert_sound(program, x, want)


def test_the_edge_program_lowers_through_xnnpack_and_the_runtime_computes_the_same() -> None:
    model, x = BnConv(oc=8, groups=2).eval(), _x()
    with torch.no_grad():
        want = [model(*x)]
    pass_ = RulesPass([fold_bn_into_conv])
    edge = to_edge(torch.export.export(model, x)).transform([pass_])
    assert pass_.last is not None and len(pass_.last.report.plans) == 1
    assert count(edge.exported_program(), "batch_norm") == 0
    lowered = edge.to_backend(XnnpackPartitioner())
    assert count(lowered.exported_program(), "convolution") == 0  # (the conv runs in the delegate)
    assert_close(run_pte(lowered.to_executorch().buffer, x), want)
