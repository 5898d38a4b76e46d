"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

from executorch.exir import EdgeProgramManager

from tests.models import ResNetish, example, randomize_bn
from tests.programs import count


def _run_example(index: int) -> dict[str, object]:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[index]
    model = randomize_bn(ResNetish())
    scope: dict[str, object] = {"model": model, "example_inputs": example(model)}
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def test_readme_example_runs() -> None:
    scope = _run_example(0)
    pte, edge = scope["pte"], scope["edge"]
    assert isinstance(pte, bytes) and len(pte) > 0
    assert isinstance(edge, EdgeProgramManager)
    assert count(edge.exported_program(), "batch_norm") == 0


def test_readme_vulkan_example_runs() -> None:
    scope = _run_example(1)
    pte, edge = scope["vulkan_pte"], scope["edge"]
    assert isinstance(pte, bytes) and len(pte) > 0
    assert isinstance(edge, EdgeProgramManager)
    assert count(edge.exported_program(), "q8ta_conv2d") == 5  # ResNetish: every conv
    assert count(edge.exported_program(), "aten.convolution") == 0
