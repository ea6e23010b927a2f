"""The docs name only modules that exist, and docs/design.md names every module there is.

A page that names a source file (``runtime/proxy.py``, ``twinkle_ray/data.py``, a bare
``proxy.py`` in a diagram, ``examples/rlhf_grpo.py``) or a dotted name
(``twinkle_ray.weights.plan``, ``twinkle_ray.core.dispatch.collect``) goes stale the day that
file is moved; these tests read README.md and every page under docs/ and fail on each name
that no longer resolves, so the page is fixed with the move. docs/design.md's module table
must also name every module of the package, so a new module is placed on the map when it
is written.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "twinkle_ray"
DESIGN = ROOT / "docs" / "design.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP_DIRS = {".venv", "node_modules", "site", ".git"}
# a path-like token ending in .py: `runtime/proxy.py`, (wire.py), tests/test_x.py
PY_FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
DOTTED = re.compile(r"\btwinkle_ray(?:\.[A-Za-z_]\w*)+")
# dotted names that are not Python objects, with the reason
NOT_OBJECTS = {
    "twinkle_ray.user": "a logger's name (get_logger)",
}


def _repo_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def _ray_root() -> Path | None:
    spec = importlib.util.find_spec("ray")
    return Path(spec.origin).parent.parent if spec and spec.origin else None


def resolves(token: str, basenames: set[str], strict: bool = False) -> bool:
    """Whether ``token`` names a file of this repository (or of Ray, for ``ray/...``).

    A path is read from the repository root or from the package (``core/mesh.py``); a bare
    name (``proxy.py``) must be some file's name: in the package when ``strict`` (design.md
    names only the package's modules bare), anywhere in the repository otherwise."""
    if "/" in token:
        if token.startswith("ray/"):
            base = _ray_root()
            return base is None or (base / token).is_file()
        return (ROOT / token).is_file() or (PACKAGE / token).is_file()
    if strict:
        return any(p.name == token for p in PACKAGE.rglob("*.py"))
    return token in basenames


def dotted_resolves(name: str) -> bool:
    """``twinkle_ray.a.b.c``: modules by their files (nothing imported for them), then
    attributes of the last module, imported (the pure ones are cheap)."""
    parts = name.split(".")
    path, i = ROOT / parts[0], 1
    while i < len(parts) and ((path / parts[i]).is_dir() or (path / f"{parts[i]}.py").is_file()):
        path, i = path / parts[i], i + 1
    if i == len(parts):
        return True
    obj = importlib.import_module(".".join(parts[:i]))
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def _names(pattern: re.Pattern) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for m in pattern.finditer(page.read_text()):
            found.append((str(page.relative_to(ROOT)), m.group(1) if m.groups() else m.group(0)))
    return found


def test_every_source_file_a_page_names_exists():
    basenames = {p.name for p in _repo_files()}
    missing = [(page, tok) for page, tok in _names(PY_FILE)
               if not resolves(tok, basenames, strict=page == "docs/design.md")]
    assert not missing, f"pages name files that do not exist (moved or gone?): {missing}"


def test_every_dotted_name_a_page_names_resolves():
    missing = []
    for page, name in _names(DOTTED):
        if name in NOT_OBJECTS or name.endswith(".md"):
            continue  # a logger's name; a page's file name (api/twinkle_ray.md)
        if not dotted_resolves(name):
            missing.append((page, name))
    assert not missing, f"pages name objects that do not exist: {missing}"


def _design_table_modules() -> set[str]:
    """Every module docs/design.md's "What each module owns" table names (package paths)."""
    table = DESIGN.read_text().split("## What each module owns", 1)[1]
    named = set()
    for row in table.splitlines():
        if row.startswith("|"):
            cells = row.split("|")
            named.update(re.findall(r"`([\w/]+(?:\.py|/))`", cells[2] if len(cells) > 2 else ""))
    return named


def test_design_names_every_module_of_the_package():
    named = _design_table_modules()
    assert "runtime/proxy.py" in named and "weights/plan.py" in named, sorted(named)
    unnamed = []
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = str(p.relative_to(PACKAGE))
        if p.name == "__init__.py" and rel != "__init__.py":
            continue  # a package's __init__ re-exports; the package's modules are what count
        if rel in named or any(rel.startswith(d) for d in named if d.endswith("/")):
            continue
        unnamed.append(rel)
    assert not unnamed, ("modules docs/design.md's 'What each module owns' table does not name; "
                         f"add a row (or a cell) for each: {unnamed}")


def test_design_table_names_no_missing_module():
    gone = [m for m in _design_table_modules()
            if not ((PACKAGE / m).is_dir() if m.endswith("/") else (PACKAGE / m).is_file())]
    assert not gone, f"docs/design.md's module table names modules that do not exist: {gone}"


@pytest.mark.parametrize("token,ok", [
    ("runtime/proxy.py", True), ("weights.py", False), ("weight_channel.py", False),
    ("integrations/vllm_trainer.py", False), ("examples/rlhf_grpo.py", True),
])
def test_the_check_catches_a_gone_module(token, ok):
    """The check itself: the modules docs/design.md used to name, now gone, are caught."""
    assert resolves(token, {p.name for p in _repo_files()}, strict=True) is ok


def test_no_citation_of_a_design_section_outside_the_repository():
    """"DESIGN n" cited a contract file that is not in the repository: a reader cannot follow
    it. A page or a comment cites a page under docs/ instead (or says it in words)."""
    cite = re.compile("DESIGN" + r" \d")
    where = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for top in ("twinkle_ray", "tests", "examples", "bench", "deploy", "scripts"):
        where += [p for p in (ROOT / top).rglob("*")
                  if p.suffix in (".py", ".md", ".yaml", ".sh") and not SKIP_DIRS & set(p.parts)]
    found = [str(p.relative_to(ROOT)) for p in where if cite.search(p.read_text(errors="replace"))]
    assert not found, f"files citing a DESIGN section: {found}"
