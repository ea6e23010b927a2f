"""Awaiting ObjectRefs in the dispatcher: every ref, the first error, or quietly.

Example::

    values = await all_or_first_error([w.start.remote() for w in workers])
    await quiet(w.stop.remote())          # None if it failed
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray


async def all_or_first_error(refs: list) -> list:
    """Await every ref; on the first failure raise it (tagged with its rank) without waiting."""
    async def one(rank, ref):
        try:
            return await ref
        except Exception as e:
            e._twinkle_rank = rank
            raise

    tasks = [asyncio.ensure_future(one(r, ref)) for r, ref in enumerate(refs)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            raise t.exception()
    return [t.result() for t in tasks]


async def values(items: list) -> list:
    """Await the ObjectRefs among ``items``; other values pass as they are."""
    return [await x if isinstance(x, ray.ObjectRef) else x for x in items]


async def quiet(ref: Any) -> Any:
    """The ref's value, or None if it failed (teardown and probes are best effort)."""
    try:
        return await ref
    except Exception:
        return None
