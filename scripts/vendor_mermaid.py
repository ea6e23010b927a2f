"""Serve Mermaid from the docs site itself, not from a CDN.

Material for MkDocs renders ```mermaid blocks with the ``mermaid`` script it
fetches from unpkg.com at page load, unless the page already defines
``mermaid``. On an air-gapped cluster that fetch fails and the diagrams show
as raw text. This script copies ``dist/mermaid.min.js`` of the npm package
``mermaid`` (pinned below) into ``docs/assets/vendor/`` (git-ignored), and
``mkdocs.yml`` loads it with ``extra_javascript``: the built site carries its
own copy.

Run by hand (``python scripts/vendor_mermaid.py``), or let MkDocs run it: it
is a hook in ``mkdocs.yml`` and fetches the package before a build when the
file is missing. Needs ``npm`` (the npm registry) once; later builds reuse
the copy.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from typing import Any

MERMAID = "mermaid@11.12.1"  # the major version Material expects (it asks unpkg for mermaid@11)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "docs", "assets", "vendor", "mermaid.min.js")


def vendor(target: str = TARGET, package: str = MERMAID) -> str:
    """Put ``dist/mermaid.min.js`` of ``package`` at ``target`` (unless it is there); returns it."""
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = subprocess.run(["npm", "pack", package, "--silent", "--pack-destination", tmp],
                                 check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise RuntimeError(f"could not fetch {package} with npm for the docs' diagrams: "
                               f"{detail.strip()[:500]}") from None
        tgz = os.path.join(tmp, out.stdout.strip().splitlines()[-1])
        with tarfile.open(tgz) as tar:
            member = tar.extractfile("package/dist/mermaid.min.js")
            if member is None:
                raise RuntimeError(f"{package} has no dist/mermaid.min.js")
            data = member.read()
    with open(target + ".tmp", "wb") as f:
        f.write(data)
    os.replace(target + ".tmp", target)
    return target


def on_pre_build(config: Any, **kwargs: Any) -> None:
    """MkDocs hook: make sure the site's copy of mermaid exists before files are collected."""
    vendor(os.path.join(config["docs_dir"], "assets", "vendor", "mermaid.min.js"))


if __name__ == "__main__":
    print(vendor())
