"""JSON over HTTP for a replica: a request's body read safely, every answer JSON.

One job: what crosses the wire to an HTTP client. :func:`read_json` reads a request's JSON
object or raises :class:`BadRequest` (a 4xx: wrong method, body too large, not JSON, nested
too deeply, not an object); nothing here unpickles bytes from a client.
:func:`json_response` answers JSON; :func:`error_response` turns any error into one: a
BadRequest's own 4xx, 503 for a gang that is down or being rebuilt, else 500, with
internals kept in the replica's log under a request id.

Example::

    >>> BadRequest("no prompt").status, error_response(BadRequest("no prompt")).status_code
    (400, 400)
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Sequence
from typing import Any

from .replica import GangUnavailable

__all__ = ["MAX_BODY_BYTES", "MAX_ERROR_CHARS", "MAX_JSON_DEPTH", "UNAVAILABLE_MESSAGE", "BadRequest",
           "error_response", "json_response", "read_json"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_ERROR_CHARS = 500


class BadRequest(ValueError):
    """A request that is not acceptable; ``status`` is the HTTP code to answer (4xx).

    ``headers`` go into the answer (``Allow`` for a 405). Messages are cut to
    ``MAX_ERROR_CHARS`` so an error never echoes a whole body back.
    """

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.status, self.headers))


def _json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, without recursion; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; ValueError for one out of a float's range (``1e999`` would
    parse to infinity, which JSON cannot carry back).

    >>> _finite_float("1.5")
    1.5
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (a float cannot hold it)")
    return value


def _float_range_int(text: str) -> int:
    """A JSON integer as an int; ValueError for one out of a float's range (a handler's
    ``float(x)`` would raise OverflowError: a 500), as for ``1e999``.

    >>> _float_range_int("12")
    12
    """
    value = int(text)  # ValueError past 4300 digits (Python's own limit)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"the number {text[:40]}... ({len(text)} characters) is out of range "
                         f"(a float cannot hold it)") from None
    return value


async def read_json(request: Any, *, max_bytes: int = MAX_BODY_BYTES,
                    max_depth: int = MAX_JSON_DEPTH, methods: Sequence[str] = ("POST",)) -> dict:
    """The JSON object in an HTTP request's body, or BadRequest (never unpickles anything).

    ``request`` is a Starlette request (what Serve passes to ``__call__``).
    Every way a request can be wrong is a :class:`BadRequest` whose
    ``status`` is the 4xx to answer: a method not in ``methods`` (405, with
    an ``Allow`` header), a ``Content-Length`` over ``max_bytes`` (413, before
    any of the body is read; a body without one is read only up to
    ``max_bytes``), a body that is not UTF-8 JSON (``NaN``/``Infinity`` are not
    JSON, nor a number out of a float's range such as ``1e999`` or a 400-digit integer),
    nested deeper than
    ``max_depth``, or not an object (400).
    """
    method = str(getattr(request, "method", "POST")).upper()
    allowed = [m.upper() for m in methods]
    if allowed and method not in allowed:
        raise BadRequest(f"method {method} is not allowed here; send {' or '.join(allowed)} with "
                         f"a JSON object as the body", status=405,
                         headers={"Allow": ", ".join(allowed)})
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
            if size < 0:
                raise ValueError
        except ValueError:
            raise BadRequest(f"Content-Length {declared[:40]!r} is not a byte count") from None
        if size > max_bytes:
            raise BadRequest(f"request body of {size} bytes exceeds {max_bytes}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise BadRequest(f"request body exceeds {max_bytes} bytes", status=413)
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant,
                          parse_float=_finite_float, parse_int=_float_range_int)
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply (more than {max_depth} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, 1e999, a 400-digit integer
        raise BadRequest(f"request body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    if _json_depth(data, max_depth) > max_depth:
        raise BadRequest(f"request body is nested too deeply (more than {max_depth} levels)")
    return data


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """A JSON HTTP response (what a Serve ``__call__`` returns), ASCII-escaped.

    Escaping keeps any string a client sent (a lone surrogate included) encodable,
    so an error message quoting the client can never turn into a 500.
    """
    from starlette.responses import Response

    body = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return Response(body.encode("ascii"), status_code=status, headers=headers,
                    media_type="application/json")


UNAVAILABLE_MESSAGE = "replica unavailable: its gang is down or being rebuilt; retry later"


def error_response(error: BaseException) -> Any:
    """The JSON error response for ``error``: a BadRequest's own 4xx, 503 for a gang that is
    dead or being rebuilt, else 500.

    Only a BadRequest's message (about the client's own request) reaches the client. A 503 or
    500 answers a short fixed text and a ``request_id``; the error itself (node addresses and
    ids, Ray's death text, another request's exception) goes to the replica's log under that id.

    Example::

        try:
            return json_response(await self.gang.call(self.gang.proxy.generate, prompts))
        except Exception as e:
            return error_response(e)  # {"error": "replica unavailable: ...", "request_id": ...}
    """
    from ..runtime.errors import WorkerDiedError

    if isinstance(error, BadRequest):
        return json_response({"error": str(error)}, error.status, error.headers)
    request_id = uuid.uuid4().hex[:16]
    if isinstance(error, GangUnavailable | WorkerDiedError):
        logger.warning("request %s answered 503: %s: %s", request_id, type(error).__name__, error)
        return json_response({"error": UNAVAILABLE_MESSAGE, "request_id": request_id}, 503,
                             {"Retry-After": "1"})
    logger.error("request %s failed", request_id, exc_info=error)
    return json_response({"error": f"internal error ({type(error).__name__}); see the replica's "
                                   f"log", "request_id": request_id}, 500)
