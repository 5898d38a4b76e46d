"""The public names of DESIGN.md resolve to the right objects, in any import order."""

from __future__ import annotations

import importlib

import adapters
import fxpure


def test_adapters_names_are_functions_even_after_submodule_imports() -> None:
    importlib.import_module("adapters.snap")
    importlib.import_module("adapters.weights")
    importlib.import_module("adapters.realize")
    assert callable(adapters.capture) and adapters.capture.__name__ == "capture"
    assert callable(adapters.materialize) and adapters.materialize.__name__ == "materialize"
    assert callable(adapters.transform) and callable(adapters.apply)
    assert adapters.check_plans.__name__ == "check_plans"  # as the README calls it
    assert adapters.passes.FuseConvBatchNormPass.__name__ == "FuseConvBatchNormPass"
    assert adapters.passes.SplitGroupConvolutionPass.__name__ == "SplitGroupConvolutionPass"
    assert adapters.passes.QuantizedConvolutionPass.__name__ == "QuantizedConvolutionPass"
    assert adapters.TransformOutcome.__name__ == "TransformOutcome"


def test_fxpure_names() -> None:
    for name in ("GraphSnapshot", "RewritePlan", "RewriteReport", "Rejection", "plan", "rewrite"):
        assert hasattr(fxpure, name)
    assert fxpure.rules.fuse_conv_bn().name == "fuse-conv-bn"
    assert fxpure.rules.split_group_conv(min_groups=2, max_groups=10).name == "split-group-conv"
    assert fxpure.rules.quantized_conv(align=4).name == "quantized-conv"
    assert set(fxpure.rules.RULES) == {
        "fuse-conv-bn",
        "split-group-conv",
        "quantized-conv",
        "fuse-linear-bn",
        "fold-binary",
        "conv1d-to-conv2d",
        "linear-to-conv2d",
        "concat-parallel-linears",
    }
    for key, factory in fxpure.rules.RULES.items():
        assert factory().name == key
