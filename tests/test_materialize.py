"""``adapters.weights.materialize``: every result owns its storage, so two derived weights never
change together, and inputs are never touched."""

from __future__ import annotations

import torch

from adapters.weights import Memo, materialize
from fxpure.snapshot import TensorSpec
from fxpure.weights import Binary, Cast, Fill, Permute, Reshape, Source, WeightExpr

W = Source(key="w", spec=TensorSpec(shape=(2, 3), dtype="float32"))
DOUBLED = Binary(op="mul", a=W, b=Fill(shape=(), value=2.0, dtype="float32"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _inputs() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def test_a_reshaped_copy_of_a_derived_weight_has_its_own_storage() -> None:
    reshaped = Reshape(x=DOUBLED, shape=(3, 2))
    expected = {DOUBLED: _inputs()["w"] * 2, reshaped: (_inputs()["w"] * 2).reshape(3, 2)}
    for order in ((DOUBLED, reshaped), (reshaped, DOUBLED)):
        tensors, memo = _inputs(), Memo()
        first, second = (materialize(e, tensors, memo) for e in order)
        assert torch.equal(first, expected[order[0]]) and torch.equal(second, expected[order[1]])
        assert _storage(first) != _storage(second)
        first.add_(100)  # a later in-place pass on one weight leaves the other as it was
        assert torch.equal(second, expected[order[1]])


def test_views_and_no_op_casts_of_an_input_are_copies_and_the_input_is_untouched() -> None:
    views: list[WeightExpr] = [Permute(x=W, dims=(1, 0)), Cast(x=W, dtype="float32"), Reshape(x=W, shape=(6,))]
    for expr in views:
        tensors = _inputs()
        out = materialize(expr, tensors, Memo())
        assert _storage(out) != _storage(tensors["w"])
        out.zero_()
        assert torch.equal(tensors["w"], _inputs()["w"])


def test_a_weight_asked_for_twice_from_one_memo_comes_back_twice_as_its_own_copy() -> None:
    tensors, memo = _inputs(), Memo()
    a, b = materialize(DOUBLED, tensors, memo), materialize(DOUBLED, tensors, memo)
    assert torch.equal(a, b) and _storage(a) != _storage(b)
