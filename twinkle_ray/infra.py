"""``twinkle_ray.infra``: the module Twinkle scripts import the runtime from.

Twinkle's ``twinkle.infra`` exposes ``initialize``, ``remote_class``,
``remote_function``, ``get_device_placement`` and ``is_master``; these are the
same objects as ``twinkle_ray.<name>``. Imports are absolute so that the module
also works when a script aliases the package (``sys.modules['twinkle'] = twinkle_ray``)
and Python loads it a second time under the name ``twinkle.infra``.

Example::

    from twinkle_ray.infra import initialize, is_master, remote_class, remote_function

    initialize("local")
    assert is_master()            # a driver is rank 0
"""

from __future__ import annotations

from twinkle_ray.core.functions import remote_function
from twinkle_ray.core.platform import is_master
from twinkle_ray.runtime.remote import remote_class
from twinkle_ray.runtime.session import get_device_placement, initialize

__all__ = ["get_device_placement", "initialize", "is_master", "remote_class", "remote_function"]

