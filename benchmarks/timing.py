"""Timing shared by the benchmarks: one pass call on a fresh copy of an edge program."""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable

import torch
from executorch.exir import EdgeProgramManager
from torch.export import ExportedProgram

# the program -> the pass to call on its graph module (built off the clock)
MakePass = Callable[[ExportedProgram], Callable[[torch.fx.GraphModule], object]]


def time_pass(original: EdgeProgramManager, make: MakePass, *, gc_off: bool = False) -> tuple[float, ExportedProgram]:
    """Seconds one pass call takes on a fresh copy (no pass manager around it), and the copy."""
    ep = copy.deepcopy(original).exported_program()
    fn = make(ep)
    if gc_off:
        gc.disable()
    try:
        t0 = time.perf_counter()
        fn(ep.graph_module)
        return time.perf_counter() - t0, ep
    finally:
        if gc_off:
            gc.enable()
