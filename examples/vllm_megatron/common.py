"""Shared bits of the vLLM / Megatron adapters: clear errors when a dependency is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ImportError):
    """A GPU framework this adapter needs is not installed here."""


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
            f"(install: {install}; it also needs CUDA GPUs). Nothing in this adapter runs "
            f"without it: it is not a stub. For a CPU run of the same flow see examples/rlhf_grpo.py."
        ) from e
