"""Shared bits of the vLLM / Megatron adapters: clear errors when a dependency is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "bash scripts/setup.sh rlhf"


class MissingDependency(ImportError):
    """A framework this adapter needs (vLLM, Megatron-Core) is not installed here."""


def require(module: str, install: str, what: str) -> ModuleType:
    """Import ``module`` or raise MissingDependency saying what to install and why.

    >>> require("json", "-", "tests").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise MissingDependency(
            f"{what} needs `{module}`, which is not installed in this environment "
            f"(install: {install}). Nothing in this adapter runs without it: it is not a stub. "
            f"For a run of the same flow without it see examples/rlhf_fsdp_hf.py."
        ) from e
