"""Rewrite rules, one per module."""

from fxpure.rules.fuse_conv_bn import FuseConvBn, fuse_conv_bn
from fxpure.rules.split_group_conv import SplitGroupConv, split_group_conv

__all__ = ["FuseConvBn", "SplitGroupConv", "fuse_conv_bn", "split_group_conv"]
