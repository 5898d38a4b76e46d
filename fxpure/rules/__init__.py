"""Rewrite rules, one per module, and the registry of their stable names."""

from collections.abc import Callable, Mapping

from fxpure.plan import Rule
from fxpure.rules.concat_parallel_linears import concat_parallel_linears
from fxpure.rules.conv1d_to_conv2d import conv1d_to_conv2d
from fxpure.rules.fold_binary import fold_binary
from fxpure.rules.fuse_conv_bn import fuse_conv_bn
from fxpure.rules.fuse_linear_bn import fuse_linear_bn
from fxpure.rules.linear_to_conv2d import linear_to_conv2d
from fxpure.rules.quantized_conv import quantized_conv
from fxpure.rules.split_group_conv import split_group_conv

# stable kebab-case name -> rule with its default policy (the CLI's --rules), in the order to run
# them in: fusions and folds first, while the conv or linear they fold into is still whole (not
# yet split, packed or re-spelled), and parallel linears merged before they become convs.
# quantized-conv reads a quantized conv1d as it is, so conv1d-to-conv2d follows it
RULES: Mapping[str, Callable[[], Rule]] = {
    "fuse-conv-bn": fuse_conv_bn,
    "fuse-linear-bn": fuse_linear_bn,
    "fold-binary": fold_binary,
    "split-group-conv": split_group_conv,
    "quantized-conv": quantized_conv,
    "conv1d-to-conv2d": conv1d_to_conv2d,
    "concat-parallel-linears": concat_parallel_linears,
    "linear-to-conv2d": linear_to_conv2d,
}

__all__ = [
    "RULES",
    "concat_parallel_linears",
    "conv1d_to_conv2d",
    "fold_binary",
    "fuse_conv_bn",
    "fuse_linear_bn",
    "linear_to_conv2d",
    "quantized_conv",
    "split_group_conv",
]
