"""Fail the docs build when a Mermaid diagram does not parse.

A diagram with a syntax error builds fine (``mkdocs build --strict`` never looks
inside a ```mermaid block) and shows on the site as raw text with Mermaid's
"Syntax error" panel: only a reader finds it. This MkDocs hook (``mkdocs.yml``)
parses every ```mermaid block of the docs pages with mermaid's own parser, in
node (``scripts/mermaid_check``: the npm packages ``mermaid``, the version the
site vendors, and ``jsdom``, whose DOM most diagram types need to parse), and
fails the build naming the page, line and parse error.

The packages are installed by ``scripts/setup.sh test`` (``npm ci``), or here
before the first check when missing; after that it runs offline. Also usable by
hand: ``python scripts/check_mermaid.py docs/*.md``. Needs ``node`` (>= 20.19).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "scripts", "mermaid_check")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*mermaid\b.*$")


def diagrams(markdown: str, where: str) -> list[dict[str, str]]:
    """The ```mermaid blocks of ``markdown``: ``[{"where": "where:LINE", "text": ...}]``.

    >>> diagrams("x\\n```mermaid\\nflowchart LR\\n  a --> b\\n```\\n", "p.md")
    [{'where': 'p.md:2', 'text': 'flowchart LR\\n  a --> b'}]
    """
    out, lines, i = [], markdown.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, start = len(m.group("indent")), m.group("fence"), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        out.append({"where": f"{where}:{start + 1}", "text": "\n".join(body)})
        i += 1
    return out


def ensure_installed(package: str = PACKAGE) -> None:
    """``npm ci`` the checker's packages (pinned by its package-lock.json) unless they are there."""
    modules = os.path.join(package, "node_modules")
    if all(os.path.isdir(os.path.join(modules, p)) for p in ("mermaid", "jsdom")):
        return
    try:
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=package,
                       check=True, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(f"could not install the Mermaid checker's packages ({package}) with "
                           f"npm ci: {detail.strip()[:500]}") from None


def check(blocks: Iterable[dict[str, str]], package: str = PACKAGE) -> list[dict[str, str]]:
    """Parse ``blocks`` (as :func:`diagrams` returns them); the ones that fail, with the error."""
    blocks = list(blocks)
    if not blocks:
        return []
    ensure_installed(package)
    try:
        out = subprocess.run(["node", os.path.join(package, "parse.mjs")], cwd=package,
                             input=json.dumps(blocks), capture_output=True, text=True,
                             check=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(f"the Mermaid checker did not run: {detail.strip()[:1000]}") from None
    return json.loads(out.stdout)


def report(failures: list[dict[str, str]]) -> str:
    """One paragraph per diagram that does not parse: where it is, then mermaid's error."""
    return "\n\n".join(f"{f['where']}: Mermaid diagram does not parse:\n{f['error']}"
                       for f in failures)


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """MkDocs hook: parse every page's diagrams before the build; a bad one fails it."""
    from mkdocs.exceptions import PluginError

    blocks = []
    for page in files.documentation_pages():
        with open(page.abs_src_path, encoding="utf-8") as f:
            blocks += diagrams(f.read(), os.path.relpath(page.abs_src_path, ROOT))
    try:
        failures = check(blocks)
    except RuntimeError as e:
        raise PluginError(str(e)) from None
    if failures:
        raise PluginError(report(failures))
    return files


if __name__ == "__main__":
    found = []
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            found += diagrams(f.read(), path)
    bad = check(found)
    print(report(bad) if bad else f"{len(found)} diagram(s) parse")
    sys.exit(1 if bad else 0)
