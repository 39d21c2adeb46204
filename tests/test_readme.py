"""The README's CPU tour runs as written."""

from __future__ import annotations

import importlib.util
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_cpu_tour_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # GPU examples run on the device; a block that picks its device itself runs here too.
    cpu = [b for b in blocks if "cupy" not in b and ("cuda" not in b or "torch.cuda.is_available()" in b)]
    assert cpu, "the README has no CPU example"
    for block in cpu:
        if "import jax" in block and importlib.util.find_spec("jax") is None:
            continue  # the jax extra is optional (and needs Python 3.11+)
        exec(compile(block, str(README), "exec"), {})
