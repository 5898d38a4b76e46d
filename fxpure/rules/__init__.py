"""Rewrite rules, one per module."""

from fxpure.rules.fuse_conv_bn import FuseConvBn, fuse_conv_bn

__all__ = ["FuseConvBn", "fuse_conv_bn"]
