"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

from executorch.exir import EdgeProgramManager

from tests.models import ResNetish, example, randomize_bn
from tests.programs import count


def test_readme_example_runs() -> None:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    model = randomize_bn(ResNetish())
    scope: dict[str, object] = {"model": model, "example_inputs": example(model)}
    exec(compile(code.group(1), "README.md", "exec"), scope)
    pte, edge = scope["pte"], scope["edge"]
    assert isinstance(pte, bytes) and len(pte) > 0
    assert isinstance(edge, EdgeProgramManager)
    assert count(edge.exported_program(), "batch_norm") == 0
