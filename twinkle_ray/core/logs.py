"""get_logger: the logger a Twinkle script writes its own messages to.

twinkle_ray itself logs quietly through ``logging.getLogger(__name__)`` and adds
no handler. A script that calls :func:`get_logger` asks for output: it gets the
``'twinkle_ray.user'`` logger with one console handler (and a file handler with
``log_file``), at ``log_level`` or the ``LOG_LEVEL`` environment variable (INFO by
default). As in Twinkle, with ``only_local_master`` (the default) a process that is
not local rank 0 logs errors only, so a gang of 8 does not print every line 8 times.

Example::

    >>> logger = get_logger(log_level=logging.WARNING)
    >>> logger.name, logger.level == logging.WARNING
    ('twinkle_ray.user', True)
"""

from __future__ import annotations

import logging
import os

from .platform import Platform

__all__ = ["USER_LOGGER", "get_logger"]

#: Name of the logger :func:`get_logger` configures.
USER_LOGGER = "twinkle_ray.user"

_FORMAT = logging.Formatter("[%(asctime)s][%(levelname)s:%(name)s] %(message)s", "%Y-%m-%d %H:%M:%S")


def _level(log_level: int | str | None) -> int:
    if log_level is None:
        log_level = os.environ.get("LOG_LEVEL", "INFO")
    if isinstance(log_level, str):
        value = logging.getLevelName(log_level.strip().upper())
        if not isinstance(value, int):
            raise ValueError(f"get_logger: unknown log level {log_level!r}")
        return value
    return int(log_level)


def get_logger(
    log_file: str | None = None,
    log_level: int | str | None = None,
    file_mode: str = "w",
    only_local_master: bool = True,
) -> logging.Logger:
    """The script's logger, set up once per process (later calls adjust level and file).

    Args:
        log_file: also write to this file (on the local master only, as Twinkle).
        log_level: a ``logging`` level or its name; default ``LOG_LEVEL`` or INFO.
        file_mode: mode the log file is opened with.
        only_local_master: processes other than local rank 0 log errors only.
    """
    logger = logging.getLogger(USER_LOGGER)
    logger.propagate = False  # its own console handler; a root handler would print it twice
    level = _level(log_level)
    master = Platform.is_local_master() or not only_local_master
    if not any(getattr(h, "_twinkle_console", False) for h in logger.handlers):
        console = logging.StreamHandler()
        console._twinkle_console = True  # type: ignore[attr-defined]
        console.setFormatter(_FORMAT)
        logger.addHandler(console)
    if log_file is not None and master:
        path = os.path.abspath(log_file)
        if not any(isinstance(h, logging.FileHandler) and h.baseFilename == path
                   for h in logger.handlers):
            handler = logging.FileHandler(path, file_mode)
            handler.setFormatter(_FORMAT)
            logger.addHandler(handler)
    for handler in logger.handlers:
        handler.setLevel(level)
    logger.setLevel(level if master else logging.ERROR)
    return logger
