"""What ExecuTorch's Vulkan ``et_vk.q8ta_conv2d*`` kernels compute, from their call arguments alone.

Written from upstream's kernel sources, never from fxpure's plans (nor from upstream's CPU reference
implementations in ``custom_ops_lib.py``, which reshape the packed weight as if it were OIHW):

* ``runtime/graph/ops/glsl/pack_q8_conv2d_weights.glsl`` (used by ``q8ta_conv2d``, ``_pw`` and
  ``_transposed``): the int8 weight buffer is read with ``orig_sizes = [OC, K_h, K_w, IC]``, ``IC``
  the input channels per group (``Q8taConv2d.cpp``: input channels / groups; ``Q8taConv2dPW.cpp``:
  all input channels, ``K_h = K_w = 1``), and the element ``(oc, ky, kx, ic)`` at byte
  ``oc * align_up_4(K_h * K_w * IC) + ky * K_w * IC + kx * IC + ic``; ``OC`` is the output's channel count.
* ``pack_q8_conv2d_dw_weights.glsl`` (``q8ta_conv2d_dw``): the weight tensor is ``[K_h, K_w, OC]``
  and the int32 word ``(h * K_w + w) * OC4 + oc4`` holds channels ``4 * oc4 .. 4 * oc4 + 3``.
* ``q8ta_conv2d.glsl``, ``q8ta_conv2d_dw.glsl``, ``q8ta_conv2d_pw.glsl``, ``q8ta_conv2d_transposed.glsl``:
  an int32 accumulator ``acc = sum x_q * w_q`` over every kernel tap, a tap outside the input (or, when
  transposed, off the stride grid) reading the input zero point; then
  ``(acc - weight_sums[oc] * input_zp) * weight_scales[oc] * input_scale + bias[oc]``, ReLU if asked,
  ``round(. / output_scale) + output_zp`` clamped to [-128, 127]. Sums, scales and bias are read a
  4-channel texel at a time (``t_weight_sums[oc4]``), so each must hold ``align_up_4(OC)`` values.
  The pw kernel ignores kernel size, stride, padding, dilation and groups (``Q8taConv2dPW.cpp``), the
  transposed kernel ignores ``output_padding`` except for the output size.

The accumulation here is exact (integers in float64); only the final scaling is float, so the oracle
is the exact value of the chain; the original program computes the same value in float32, and the
two can round to adjacent int8 values when it lies within float32's error of a rounding tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

QMIN, QMAX = -128, 127


def align4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class Call:
    """One q8ta conv call, by the schema's argument names (``custom_ops_lib.py``)."""

    kernel: str  # "q8ta_conv2d", "q8ta_conv2d_pw", "q8ta_conv2d_dw", "q8ta_conv2d_transposed"
    input_scale: float
    input_zero_point: int
    weights: torch.Tensor
    weight_sums: torch.Tensor
    weight_scales: torch.Tensor
    output_scale: float
    output_zero_point: int
    bias: torch.Tensor | None
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    output_padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    activation: str


def _pair(v: Any) -> tuple[int, int]:
    a, b = (int(x) for x in v)
    return a, b


def parse(target: str, args: Sequence[Any]) -> Call:
    """The call's arguments after the input, in schema order (``output_padding`` only when transposed)."""
    kernel = next(
        k for k in ("q8ta_conv2d_transposed", "q8ta_conv2d_pw", "q8ta_conv2d_dw", "q8ta_conv2d") if k in target
    )
    _, x_scale, x_zp, w, sums, scales, o_scale, o_zp, bias, ks, stride, padding, *rest = args
    out_pad = rest.pop(0) if kernel == "q8ta_conv2d_transposed" else (0, 0)
    dilation, groups, activation = rest
    for name, t in (("weights", w), ("weight_sums", sums), ("weight_scales", scales)):
        assert isinstance(t, torch.Tensor), f"{name} is not a constant tensor"
    assert bias is None or isinstance(bias, torch.Tensor)
    assert activation in ("none", "relu"), activation  # Q8taConv2d.cpp: activation_type_from_string
    return Call(
        kernel=kernel,
        input_scale=float(x_scale),
        input_zero_point=int(x_zp),
        weights=w,
        weight_sums=sums,
        weight_scales=scales,
        output_scale=float(o_scale),
        output_zero_point=int(o_zp),
        bias=bias,
        kernel_size=_pair(ks),
        stride=_pair(stride),
        padding=_pair(padding),
        output_padding=_pair(out_pad),
        dilation=_pair(dilation),
        groups=int(groups),
        activation=str(activation),
    )


def im2col_weight(w: torch.Tensor, oc: int, kh: int, kw: int, ic: int) -> torch.Tensor:
    """``pack_q8_conv2d_weights.glsl``'s reading of the weight buffer: ``[OC, K_h, K_w, IC]`` (int64),
    element ``(o, y, x, i)`` at ``o * align_up_4(K_h * K_w * IC) + y * K_w * IC + x * IC + i``."""
    assert w.dtype == torch.int8, w.dtype
    row = align4(kh * kw * ic)
    flat = w.contiguous().reshape(-1).to(torch.int64)
    assert flat.numel() == oc * row, f"packed weight has {flat.numel()} values, the layout {oc} x {row}"
    o = torch.arange(oc).view(oc, 1, 1, 1)
    y = torch.arange(kh).view(1, kh, 1, 1)
    x = torch.arange(kw).view(1, 1, kw, 1)
    i = torch.arange(ic).view(1, 1, 1, ic)
    return flat[o * row + y * (kw * ic) + x * ic + i]


def dw_weight(w: torch.Tensor) -> torch.Tensor:
    """``pack_q8_conv2d_dw_weights.glsl``'s reading: a ``[K_h, K_w, OC]`` tensor, int32 word
    ``(h * K_w + w) * OC4 + oc4`` holding channels ``4 * oc4 ..``; returns ``[K_h, K_w, 4 * OC4]`` (int64)."""
    assert w.dtype == torch.int8 and w.dim() == 3, (w.dtype, w.shape)
    kh, kw, oc = w.shape
    words = align4(oc) // 4
    flat = w.contiguous().reshape(-1).to(torch.int64)
    assert flat.numel() == kh * kw * 4 * words, f"dw weight {tuple(w.shape)} does not fill whole int32 words"
    h = torch.arange(kh).view(kh, 1, 1)
    x = torch.arange(kw).view(1, kw, 1)
    c = torch.arange(4 * words).view(1, 1, -1)
    return flat[((h * kw + x) * words + c // 4) * 4 + c % 4]


def _texel_vector(t: torch.Tensor, oc: int, name: str) -> torch.Tensor:
    """A per-channel buffer read by 4-channel texels: it must hold ``align_up_4(OC)`` values."""
    flat = t.reshape(-1)
    assert flat.numel() >= align4(oc), f"{name} holds {flat.numel()} values, the kernel reads {align4(oc)}"
    return flat[:oc]


def _taps(out: int, size: int, k: int, stride: int, pad: int, dil: int, transposed: bool) -> tuple[Any, Any]:
    """For each output index and kernel tap ``k``: the input index and whether the kernel reads it."""
    o = torch.arange(out)
    if transposed:  # q8ta_conv2d_transposed.glsl: (o + pad - k) / stride, exact and in bounds
        num = o + pad - k
        idx = torch.div(num, stride, rounding_mode="floor")
        ok = (num >= 0) & (num % stride == 0) & (idx < size)
    else:  # q8ta_conv2d.glsl / _dw: o * stride - pad + k * dilation, in bounds
        idx = o * stride - pad + k * dil
        ok = (idx >= 0) & (idx < size)
    return idx.clamp(0, size - 1), ok


def out_size(c: Call, h: int, w: int) -> tuple[int, int]:
    if c.kernel == "q8ta_conv2d_pw":
        return h, w
    sizes = []
    for n, k, s, p, op, d in zip((h, w), c.kernel_size, c.stride, c.padding, c.output_padding, c.dilation, strict=True):
        if c.kernel == "q8ta_conv2d_transposed":
            sizes.append((n - 1) * s - 2 * p + d * (k - 1) + op + 1)
        else:
            sizes.append((n + 2 * p - d * (k - 1) - 1) // s + 1)
    return sizes[0], sizes[1]


def accumulate(c: Call, x: torch.Tensor, pad: int, oc: int, *, absolute: bool = False) -> torch.Tensor:
    """The kernel's integer accumulator ``sum x * w`` (exact, as float64) over every tap, a tap the
    kernel does not read contributing ``pad * w``; with ``absolute``, ``sum |x| * |w|`` instead."""
    n, ic_total, h, w = x.shape
    xs = x.to(torch.float64)
    oh, ow = out_size(c, h, w)
    transposed = c.kernel == "q8ta_conv2d_transposed"
    acc = torch.zeros(n, oc, oh, ow, dtype=torch.float64)
    if c.kernel == "q8ta_conv2d_pw":  # 1x1, stride 1, no padding, no groups: whatever the arguments say
        wk = im2col_weight(c.weights, oc, 1, 1, ic_total).to(torch.float64)[:, 0, 0, :]
        wk = wk.abs() if absolute else wk
        return torch.einsum("nihw,oi->nohw", xs, wk)
    kh, kw = c.kernel_size
    if transposed:  # Q8taConv2dTransposed.cpp
        assert c.dilation == (1, 1), "q8ta_conv2d_transposed only supports dilation=1"
    if c.kernel == "q8ta_conv2d_dw":
        assert c.groups == ic_total == oc, "q8ta_conv2d_dw: groups == input channels == output channels"
        wd = dw_weight(c.weights).to(torch.float64)
        assert wd.shape[:2] == (kh, kw), f"dw weight {tuple(wd.shape[:2])} is not the kernel size {(kh, kw)}"
        wd = wd.abs() if absolute else wd
    else:
        g = c.groups
        assert ic_total % g == 0 and oc % g == 0, f"{ic_total} -> {oc} channels in {g} groups"
        icg, ocg = ic_total // g, oc // g
        if g > 1:  # Q8taConv2d{,Transposed}.cpp: VK_CHECK_COND(in_channels_per_group % 4 == 0); the shaders
            # give a 4-channel output block one group (group_idx = oc4 * 4 / OC_per_group)
            assert icg % 4 == 0, (
                f"{c.kernel}: {icg} input channels per group; the Vulkan runtime rejects the call "
                "(VK_CHECK_COND(in_channels_per_group % 4 == 0))"
            )
            assert ocg % 4 == 0, f"{c.kernel}: {ocg} output channels per group: a 4-channel block would span groups"
        wi = im2col_weight(c.weights, oc, kh, kw, icg).to(torch.float64)
        wi = wi.abs() if absolute else wi
    for ky in range(kh):
        rows, row_ok = _taps(oh, h, ky, c.stride[0], c.padding[0], c.dilation[0], transposed)
        for kx in range(kw):
            cols, col_ok = _taps(ow, w, kx, c.stride[1], c.padding[1], c.dilation[1], transposed)
            ok = row_ok.view(-1, 1) & col_ok.view(1, -1)
            patch = torch.where(ok, xs[:, :, rows][:, :, :, cols], float(pad))  # (n, ic, oh, ow)
            if c.kernel == "q8ta_conv2d_dw":
                acc += patch * wd[ky, kx, :oc].view(1, oc, 1, 1)
                continue
            for gi in range(c.groups):
                part = patch[:, gi * icg : (gi + 1) * icg]
                acc[:, gi * ocg : (gi + 1) * ocg] += torch.einsum(
                    "nihw,oi->nohw", part, wi[gi * ocg : (gi + 1) * ocg, ky, kx]
                )
    return acc


@dataclass(frozen=True)
class Result:
    q: torch.Tensor  # int8, what the kernel stores
    value: torch.Tensor  # float64: the value it rounds (real units, after bias and ReLU)
    magnitude: torch.Tensor  # float64: sum |x - zp| |w| scales + |bias|, for float32 error bounds
    taps: int  # terms per output value


def run(c: Call, x: torch.Tensor, out_channels: int) -> Result:
    """The kernel's output for int8 input ``x`` (N, C, H, W)."""
    assert x.dtype == torch.int8 and x.dim() == 4, (x.dtype, x.shape)
    oc, zp = out_channels, c.input_zero_point
    acc = accumulate(c, x, zp, oc)
    sums = _texel_vector(c.weight_sums, oc, "weight_sums")
    assert sums.dtype == torch.int32, sums.dtype
    scales = _texel_vector(c.weight_scales, oc, "weight_scales").to(torch.float64).view(1, oc, 1, 1)
    bias = (
        torch.zeros(1, oc, 1, 1, dtype=torch.float64)
        if c.bias is None
        else _texel_vector(c.bias, oc, "bias").to(torch.float64).view(1, oc, 1, 1)
    )
    centered = acc - zp * sums.to(torch.float64).view(1, oc, 1, 1)
    value = centered * scales * c.input_scale + bias
    if c.activation == "relu":
        value = value.clamp(min=0.0)
    q = torch.clamp(torch.round(value / c.output_scale) + c.output_zero_point, QMIN, QMAX).to(torch.int8)
    centered_x = (x.to(torch.int64) - zp).abs()
    magnitude = accumulate(c, centered_x, 0, oc, absolute=True) * scales.abs() * c.input_scale + bias.abs()
    if c.kernel == "q8ta_conv2d_pw":
        taps = x.shape[1]
    elif c.kernel == "q8ta_conv2d_dw":
        taps = c.kernel_size[0] * c.kernel_size[1]
    else:
        taps = c.kernel_size[0] * c.kernel_size[1] * x.shape[1] // c.groups
    return Result(q=q, value=value, magnitude=magnitude, taps=taps)


def assert_matches(r: Result, want: torch.Tensor, want_float: torch.Tensor, scale: float, what: str) -> int:
    """The oracle's int8 equals the original chain's, except on a rounding tie: one step apart, with the
    chain's float32 value (``want_float``, what it quantized) within float32's error bound of the exact
    value, so a half-integer lies between them. Returns the number of ties."""
    assert want.dtype == torch.int8 and r.q.shape == want.shape, f"{what}: {tuple(r.q.shape)} vs {tuple(want.shape)}"
    off = r.q != want
    if not off.any():
        return 0
    u = 2.0**-24
    # dequantize (x - zp) * s, w * s, their product, the sum of ``taps`` of them, + bias, then * 1/scale
    bound = u * ((r.taps + 6) * r.magnitude + 4 * r.value.abs())
    gap = (r.value - want_float.to(torch.float64)).abs()
    steps = (r.q.to(torch.int32) - want.to(torch.int32)).abs()
    bad = off & ((steps != 1) | (gap > bound))
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {want.numel()} int8 values differ off a rounding tie; at {i}: "
            f"kernel {int(r.q[i])} (exact {float(r.value[i] / scale):.6f} steps), "
            f"chain {int(want[i])} (float32 {float(want_float[i]) / scale:.6f} steps)"
        )
    return int(off.sum())
