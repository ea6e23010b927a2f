"""The docs' Mermaid diagrams parse (scripts/check_mermaid.py, also a hook of the docs build),
and the checker catches the sequence diagram that once shipped broken (issue 27, item 12)."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node")

# docs/concepts.md's "One call's route" before the fix: a ';' ends a sequence-diagram statement.
BROKEN = """sequenceDiagram
    autonumber
    participant Dr as driver (GangProxy)
    participant D as dispatcher (sequencer)
    Dr->>Dr: split arguments by data rank (dispatch mode);<br/>ray.put large pieces once
    Dr->>D: call(method, refs to pieces)
"""


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_mermaid",
                                                  os.path.join(ROOT, "scripts", "check_mermaid.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(checker):
    """One node run for every diagram of the docs plus the broken one."""
    blocks = [{"where": "broken.md:1", "text": BROKEN}]
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            blocks += checker.diagrams(f.read(), os.path.relpath(path, ROOT))
    return blocks, checker.check(blocks)


@pytest.mark.slow
def test_every_diagram_of_the_docs_parses(results):
    blocks, failures = results
    assert len(blocks) >= 5  # the broken one and the docs' own (4 today)
    assert [f for f in failures if f["where"] != "broken.md:1"] == []


def test_the_old_route_diagram_fails_naming_its_line(results, checker):
    _, failures = results
    [bad] = [f for f in failures if f["where"] == "broken.md:1"]
    assert "Parse error on line 5" in bad["error"] and "(dispatch mode);" in bad["error"]
    assert "broken.md:1: Mermaid diagram does not parse" in checker.report([bad])
