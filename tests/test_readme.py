"""The README's Python blocks run as written (docs are executable), with the built-in model."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

pytestmark = pytest.mark.docs


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks(REPO / "README.md"))))
def test_readme_block_runs(index, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    exec(compile(python_blocks(REPO / "README.md")[index], f"README.md block {index}", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "every README block shows its reader something"
    if index == 0:  # every level prints the same text
        texts = [line.split(" ", 1)[1] for line in printed.strip().splitlines()]
        assert len(texts) == 5 and len(set(texts)) == 1
