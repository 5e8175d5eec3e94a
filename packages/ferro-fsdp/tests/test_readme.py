"""The README's example runs as written (one rank outside ferrorun)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_training_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    fsdp, loss = scope["fsdp"], scope["loss"]
    assert fsdp.backend.world_size == 1 and loss < 2.0
