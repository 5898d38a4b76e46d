"""materialize: evaluate a WeightExpr with torch. Never mutates an input tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from adapters.torchnames import dtype_of
from fxpure.weights import (
    Binary,
    Cast,
    Concat,
    Dequantize,
    Fill,
    MatMul,
    MaxOver,
    PadTo,
    Permute,
    Quantize,
    Reshape,
    Slice,
    Source,
    SumOver,
    Unary,
    Unsqueeze,
    WeightExpr,
    Within,
    sources,
)

Eval = Callable[[WeightExpr], torch.Tensor]
Memo = dict[object, torch.Tensor]


def _pad_to(e: PadTo, ev: Eval) -> torch.Tensor:
    x = ev(e.x)
    dim = e.dim % x.dim()
    size = x.shape[dim]
    padded = -(-size // e.multiple) * e.multiple
    out = x.new_zeros((*x.shape[:dim], padded, *x.shape[dim + 1 :]))
    out.narrow(dim, 0, size).copy_(x)
    return out


def _sum_over(e: SumOver, ev: Eval) -> torch.Tensor:
    dtype = dtype_of(e.dtype)
    return ev(e.x).to(dtype).sum(dim=e.dims, dtype=dtype)


def _along(t: torch.Tensor, axis: int | None, rank: int) -> torch.Tensor:
    """A per-tensor or per-channel parameter shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    if axis is None:
        return t.reshape(())
    shape = [1] * rank
    shape[axis % rank] = -1
    return t.reshape(shape)


def quantized_values(e: Quantize, ev: Eval) -> torch.Tensor:
    """``round(x * (1 / scale)) + zero_point`` in float32: what a quantization clamps and casts (a
    NaN here, of ``x`` or of ``0 * (1 / 0)``, has no integer: the adapter declines it)."""
    x = ev(e.x).to(torch.float32)
    scale = _along(ev(e.scale).to(torch.float32), e.axis, x.dim())
    zero = _along(ev(e.zero_point).to(torch.float32), e.axis, x.dim())
    # x * (1 / scale), as torch's quantize_per_tensor / _per_channel round it (x / scale can round a tie the other way)
    return torch.round(x * (1.0 / scale)) + zero


def _quantize(e: Quantize, ev: Eval) -> torch.Tensor:
    return _clamped(quantized_values(e, ev), e.quant_min, e.quant_max).to(dtype_of(e.dtype))


def _clamped(q: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """``q`` (whole numbers, or infinite) clamped to ``[low, high]`` exactly. In float32, int32's top
    (2**31 - 1) is 2**31, and that value cast to int32 is undefined (3e9 came out -2**31): past
    float32's whole numbers, ``q`` is clamped as int64, and what lies past int64 is the bound itself.
    (Bounds float32 holds, as int8's and int16's, are clamped in float32: no copy of a large weight.)"""
    if max(abs(low), abs(high)) <= 2**24:
        return torch.clamp(q, low, high)
    wide = q.to(torch.float64)
    big, small = wide >= 2.0**63, wide < -(2.0**63)
    whole = torch.where(big | small, 0.0, wide).to(torch.int64).clamp(low, high)
    return torch.where(big, high, torch.where(small, low, whole))


def _dequantize(e: Dequantize, ev: Eval) -> torch.Tensor:
    work = torch.float64 if e.dtype == "float64" else torch.float32  # at least float32, as wide as the result
    x = ev(e.x).to(work)
    scale = _along(ev(e.scale).to(work), e.axis, x.dim())
    zero = _along(ev(e.zero_point).to(work), e.axis, x.dim())
    return ((x - zero) * scale).to(dtype_of(e.dtype))


def _fill(e: Fill) -> torch.Tensor:
    dtype = dtype_of(e.dtype)
    if not dtype.is_floating_point:
        return torch.full(e.shape, e.value, dtype=dtype)
    # a number beyond the dtype's range is inf, as torch makes a Python number an operand of that
    # dtype (``x * 1e300`` of float32); ``full`` refuses it, and an int past int64 (2**64)
    return torch.full(e.shape, float(e.value), dtype=torch.float64).to(dtype)


_BINARY: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor,
    "shift_left": torch.bitwise_left_shift,
    "shift_right": torch.bitwise_right_shift,
}
_UNARY: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "neg": torch.neg,
    "reciprocal": torch.reciprocal,
    "abs": torch.abs,
    "sign": torch.sign,
}

_RULES: Mapping[type, Callable[[Any, Eval], torch.Tensor]] = {
    Permute: lambda e, ev: ev(e.x).permute(e.dims),
    Reshape: lambda e, ev: ev(e.x).reshape(e.shape),
    Unsqueeze: lambda e, ev: ev(e.x).unsqueeze(e.dim),
    Slice: lambda e, ev: ev(e.x).narrow(e.dim, e.start, e.stop - e.start),
    Within: lambda e, ev: ev(e.x),  # (its condition is checked apart: adapters.realize._outside)
    PadTo: _pad_to,
    SumOver: _sum_over,
    MaxOver: lambda e, ev: ev(e.x).amax(dim=e.dims),
    Cast: lambda e, ev: ev(e.x).to(dtype_of(e.dtype)),
    Concat: lambda e, ev: torch.cat([ev(x) for x in e.xs], dim=e.dim),
    Fill: lambda e, _: _fill(e),
    Binary: lambda e, ev: _BINARY[e.op](ev(e.a), ev(e.b)),
    Unary: lambda e, ev: _UNARY[e.op](ev(e.x)),
    MatMul: lambda e, ev: torch.matmul(ev(e.a), ev(e.b)),  # (mm, or mv for a vector)
    Quantize: _quantize,
    Dequantize: _dequantize,
}


def in_float64(expr: WeightExpr, given: Callable[[WeightExpr], torch.Tensor | None]) -> torch.Tensor:
    """``expr`` computed with its floating values held in float64 (a cast to float32, float16 or
    bfloat16 kept wide: exact for a sum, difference or product of two float32 numbers, and closer
    than float32 for the others), but for the parts whose values ``given`` gives (the sources, and
    what is to be taken as computed)."""
    memo: dict[WeightExpr, torch.Tensor] = {}

    def ev(e: WeightExpr) -> torch.Tensor:
        known = given(e)
        if known is None:
            known = memo.get(e)
        if known is None:
            if isinstance(e, Cast) and e.dtype in ("float32", "float16", "bfloat16"):
                known = memo[e] = ev(e.x).double()
            else:
                known = memo[e] = _RULES[type(e)](e, ev)
        return known.double() if known.dtype is torch.float32 else known

    with torch.no_grad():
        return ev(expr)


# memo keys (_RETURNED, storage address) for the results already given out (the memo keeps them
# alive, so an address is not reused meanwhile; empty results share address 0 and are copied: harmless)
_RETURNED = "returned"


@contextlib.contextmanager
def plain_torch() -> Iterator[None]:
    """Torch as the program's own dtypes and autograd have it, whatever modes the caller is in: out
    of inference mode (a weight made in it is an inference tensor, which no later pass may make
    require grad: ``to_edge`` failed on the program) and with autocast off (it ran a new conv in
    bfloat16, and a right plan was refused for computing another dtype than planned)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _laid_out(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides ``torch.empty`` gives its shape. ``contiguous()`` keeps a view whose
    size-1 dims have other strides (a (10, 1, 1, 1) weight reshaped from a (1, 10) one transposed
    has strides (1, 10, 10, 10)): torch calls it contiguous, but ExecuTorch reads its dim order off
    the strides, (1, 2, 3, 0), and its portable conv refused the weight when the ``.pte`` ran."""
    step, strides = 1, []
    for d in reversed(t.shape):
        strides.append(step)
        step *= max(d, 1)
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)


def materialize(expr: WeightExpr, tensors: Mapping[str, torch.Tensor], memo: Memo | None = None) -> torch.Tensor:
    """Evaluate ``expr``; ``Source(key)`` reads ``tensors[key]``. The result owns its storage, and
    no more than it: it shares none with an input, nor with an earlier result of the same ``memo``,
    nor is it a slice of a larger value (which would be saved whole).

    Pass one ``memo`` to several calls to compute shared sub-expressions once. It keeps every value
    it computed alive, results included: change no result in place before the last call with it.
    """
    cache: Memo = {} if memo is None else memo
    read: set[str] = set()

    def ev(e: WeightExpr) -> torch.Tensor:
        if isinstance(e, Source):
            read.add(e.key)
            return tensors[e.key].detach()
        value = cache.get(e)
        if value is None:
            value = cache[e] = _RULES[type(e)](e, ev)
        elif not read:  # from the memo, on a path that read nothing yet: the result may be a view of it
            read.update(sources(e))
        return value

    with torch.no_grad():
        owned = _laid_out(ev(expr))
    storage = owned.untyped_storage()
    ptr = storage.data_ptr()
    if (
        (_RETURNED, ptr) in cache
        or any(tensors[k].untyped_storage().data_ptr() == ptr for k in read)
        or storage.nbytes() != owned.numel() * owned.element_size()
    ):
        # a view or no-op cast of an input, or of a constant an earlier call returned (a reshaped
        # copy of a derived weight, say): two weights in one storage would change together; or a
        # slice of a larger value, such as one group of a fused weight
        owned = owned.clone()
    cache[(_RETURNED, owned.untyped_storage().data_ptr())] = owned
    return owned
