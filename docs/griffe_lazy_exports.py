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
And it fences doctest examples (runs of ``>>>`` lines and their output) as
``pycon`` code: Markdown would read ``>>>`` as three nested block quotes.
Not part of the package; used by ``mkdocs.yml`` only.
"""

from __future__ import annotations

import importlib
import re
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
            obj.docstring.value = fence_doctests(_ROLE.sub(_role_to_code, obj.docstring.value))
