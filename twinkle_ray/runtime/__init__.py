"""The Ray runtime: placement, workers, the dispatcher, gangs, lazy results, the session.

Built on the pure :mod:`twinkle_ray.core`; the integrations (``twinkle_ray.data``,
``.weights``, ``.serve``, ``.cli``) sit on top of it. Users normally import from
``twinkle_ray`` itself.

Example::

    from twinkle_ray.runtime.session import initialize, shutdown
    from twinkle_ray.core.group import DeviceGroup

    initialize(groups=[DeviceGroup("g", 2, "cpu")])
    shutdown()
"""
