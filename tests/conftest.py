"""Shared helpers: build a model in each of the three program forms."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore")
