"""twinkle_ray benchmarks: every hot path against hand-written raw Ray, in one run.

Run ``python -m bench`` (``--quick`` for a short run, ``--json`` for JSON).
See BENCHMARKS.md for the figures on the reference machine.
"""
