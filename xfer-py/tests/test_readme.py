"""The README's Python example runs as it is written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, f"expected one Python example in README.md, found {len(blocks)}"
    exec(compile(blocks[0], "README.md", "exec"), {})
