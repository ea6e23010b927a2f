"""docs/routing.md's Python blocks run as written: the rule's examples are true of the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "routing.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
RUNNABLE = [b for b in BLOCKS if "trainer." not in b]  # the one sketch needs gangs


def test_the_page_has_runnable_examples():
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_each_example_runs(block):
    exec(compile(block, str(PAGE), "exec"), {})
