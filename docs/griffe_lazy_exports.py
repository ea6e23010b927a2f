"""Griffe extension for the API reference: names in ``__all__`` that a package exports lazily.

``twinkle_ray`` exports ``LazyResult`` through a module ``__getattr__`` (so that
``import twinkle_ray.core.mesh`` stays free of Ray). Griffe reads the source
statically and does not see such a name, so ``::: twinkle_ray.LazyResult``
would fail. This extension imports the package, and for every ``__all__`` name
griffe did not find it adds an alias to wherever the object really lives
(``obj.__module__``), so the docs name objects by their public path and keep
working when modules move.

It also turns the Sphinx roles some docstrings use (``:class:`~x.Y```) into inline
code, which is how they read in the source; Markdown would show the role verbatim.
It fences doctest examples (runs of ``>>>`` lines and their output) as
``pycon`` code: Markdown would read ``>>>`` as three nested block quotes. And it
reads reST literal blocks (``Example::`` and an indented block) as Markdown would
have them: the line ends in one colon and the block becomes a fenced code block
(``python`` when it parses as Python), where Markdown would show the ``::``.
Not part of the package; used by ``mkdocs.yml`` only.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")


def _role_to_code(match: re.Match) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def fence_doctests(text: str) -> str:
    r"""Wrap every doctest run (a ``>>>`` line up to the next blank line) in a ``pycon`` fence.

    >>> fence_doctests("Text:\n>>> 1 + 1\n2\n\nMore.").splitlines()
    ['Text:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        body = line.lstrip()
        if body.startswith("```"):
            fenced = not fenced
        elif not fenced and body.startswith(">>>"):
            indent = line[: len(line) - len(body)]
            if out and out[-1].strip():
                out.append("")  # a fence starts a block of its own
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(block: str) -> str:
    if block.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(block)
    except SyntaxError:
        return "text"
    return "python"


def fence_literal_blocks(text: str) -> str:
    r"""Turn each reST literal block (a line ending in ``::``, then an indented block) into a
    fenced code block under the line, which keeps one colon (none after a space, as in reST).

    >>> fence_literal_blocks("Example::\n\n    x = f(1)\n\nMore.").splitlines()
    ['Example:', '', '```python', 'x = f(1)', '```', '', 'More.']
    >>> fence_literal_blocks("A tree: ::\n\n    DIR/step-1/  (a step)\n\nMore.").splitlines()
    ['A tree:', '', '```text', 'DIR/step-1/  (a step)', '```', '', 'More.']
    """
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
        if fenced or not stripped.endswith("::") or stripped.startswith(("..", ">>>")):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        if j == end:  # no indented block follows: not a literal block
            out.append(line)
            i += 1
            continue
        block = textwrap.dedent("\n".join(lines[j:end]))
        head = line.rstrip()[:-2]
        pad = " " * base
        out.append(head.rstrip() if head.endswith(" ") else head + ":")
        out += ["", f"{pad}```{_language(block)}"]
        out += [f"{pad}{b}" if b.strip() else "" for b in block.split("\n")]
        out.append(f"{pad}```")
        i = end
    return "\n".join(out)


class LazyExports(griffe.Extension):
    """Alias every ``__all__`` name of ``packages`` that static analysis missed."""

    def __init__(self, packages: list[str] | None = None) -> None:
        super().__init__()
        self.packages = set(packages or ["twinkle_ray"])

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in self.packages:
            return
        module = importlib.import_module(pkg.name)
        for name in getattr(module, "__all__", []):
            if name in pkg.members:
                continue
            obj = getattr(module, name)
            target = f"{obj.__module__}.{obj.__qualname__}"
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = fence_literal_blocks(_ROLE.sub(_role_to_code, obj.docstring.value))
            obj.docstring.value = fence_doctests(text)
