"""Rewrite rules, one per module, and the registry of their stable names."""

from collections.abc import Callable, Mapping

from fxpure.plan import Rule
from fxpure.rules.fuse_conv_bn import fuse_conv_bn
from fxpure.rules.quantized_conv import quantized_conv
from fxpure.rules.split_group_conv import split_group_conv

# stable kebab-case name -> rule with its default policy
RULES: Mapping[str, Callable[[], Rule]] = {
    "fuse-conv-bn": fuse_conv_bn,
    "split-group-conv": split_group_conv,
    "quantized-conv": quantized_conv,
}

__all__ = ["RULES", "fuse_conv_bn", "quantized_conv", "split_group_conv"]
