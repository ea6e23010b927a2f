"""The pure core: mesh maths, dispatch and collect rules, routing, groups, samplers.

Nothing here imports Ray or torch (``tests/test_layers.py`` checks it), so these
modules can be used and tested on their own, e.g. to plan a mesh on a laptop.

Example::

    from twinkle_ray.core.mesh import DeviceMesh
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    assert mesh.data_world_size == 2
"""
