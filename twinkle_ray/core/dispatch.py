"""How call arguments reach the workers of a gang and how their results come back.

The public face of the split and collect rules: it holds no rule itself, it names the
modules that each do one job and re-exports their API, so ``from twinkle_ray.core.dispatch
import ...`` reaches every one of them.

- :mod:`twinkle_ray.core.modes`: the dispatch, execute and collect modes there are, and
  the checks that refuse any other.
- :mod:`twinkle_ray.core.batch`: what a batch is to the rules: its length along dim 0
  (:func:`batch_len`), a slice of it (:func:`take`), pieces joined (:func:`concat`), the
  divmod split (:func:`split_sizes`, :func:`span`).
- :mod:`twinkle_ray.core.worker_ranks`: which workers run a call (:func:`call_targets`) and
  which global and data rank each worker is (:func:`worker_data_ranks`).
- :mod:`twinkle_ray.core.split`: the split rules, one call's ``(args, kwargs)`` per worker
  (:func:`dispatch`) and one value's part (:func:`split_arg`) under ``'slice'``, ``'all'``,
  ``'slice_dp'`` or a dispatch function.
- :mod:`twinkle_ray.core.collect`: the collect rules, the per-worker results of one call
  joined (:func:`collect`) under ``'none'``, ``'flatten'``, ``'mean'``, ``'sum'``,
  ``'first'``, ``'last_pp'``, ``'last_pp_first'`` or a callable.

All of them are pure: numpy only, no Ray. torch is never imported; a value is a tensor only
if torch is already imported by the caller (``sys.modules``), so the rules work (and stay
cheap to import) on machines without torch.

Example: one call's batch over 4 workers, and the 4 results joined back::

    >>> calls = dispatch('slice', 4, (list(range(10)),), {})
    >>> [a[0] for a, _ in calls]
    [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    >>> collect('flatten', [a[0] for a, _ in calls])
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""

from __future__ import annotations

from .batch import View, batch_len, concat, is_tensor, span, split_sizes, take
from .collect import collect, collect_sources, elementwise
from .modes import (
    COLLECT_MODES,
    DISPATCH_MODES,
    EXECUTE_MODES,
    check_collect,
    check_dispatch,
    check_execute,
)
from .split import (
    Split,
    dispatch,
    dispatch_one,
    is_list,
    runner_splits,
    slice_length,
    split_arg,
    worker_splits,
)
from .worker_ranks import call_targets, peer_workers, worker_data_ranks, worker_global_rank

__all__ = [
    'COLLECT_MODES',
    'DISPATCH_MODES',
    'EXECUTE_MODES',
    'Split',
    'View',
    'batch_len',
    'call_targets',
    'check_collect',
    'check_dispatch',
    'check_execute',
    'collect',
    'collect_sources',
    'concat',
    'dispatch',
    'dispatch_one',
    'elementwise',
    'is_list',
    'is_tensor',
    'peer_workers',
    'runner_splits',
    'slice_length',
    'span',
    'split_arg',
    'split_sizes',
    'take',
    'worker_data_ranks',
    'worker_global_rank',
    'worker_splits',
]
