"""Validation of a method's settings: which dispatch, execute and collect modes there are.

One job: the names of the modes (:data:`DISPATCH_MODES`, :data:`EXECUTE_MODES`,
:data:`COLLECT_MODES`) and the checks that refuse any other, at decoration time
(``@remote_function``) and before a call splits or joins anything. :func:`where` names a
call the same way in every error of the split rules. Pure module: no Ray, no numpy.

Example::

    >>> check_dispatch('slice_dp'); check_execute('peer'); check_collect('flatten')
    >>> check_collect('concat')
    Traceback (most recent call last):
    ValueError: unknown collect mode 'concat'; expected one of 'none', 'flatten', 'mean', 'sum', 'first', 'last_pp', 'last_pp_first' or a callable
"""

from __future__ import annotations

from typing import Any

__all__ = [
    'COLLECT_MODES',
    'DISPATCH_MODES',
    'EXECUTE_MODES',
    'check_collect',
    'check_dispatch',
    'check_execute',
    'where',
]

DISPATCH_MODES = ('slice', 'all', 'slice_dp', 'balance')
EXECUTE_MODES = ('all', 'first', 'peer')
COLLECT_MODES = ('none', 'flatten', 'mean', 'sum', 'first', 'last_pp', 'last_pp_first')


def where(method: str, group: str) -> str:
    """How an error names the call: ``"<method>() on group '<group>'"``.

    >>> where('sample', 'sampler')
    "sample() on group 'sampler'"
    """
    return f"{method}() on group '{group}'"


def _check_mode(kind: str, mode: Any, allowed: tuple[str, ...], allow_callable: bool) -> None:
    if isinstance(mode, str):
        if mode in allowed:
            return
    elif allow_callable and callable(mode):
        return
    choices = ', '.join(repr(m) for m in allowed)
    extra = ' or a callable' if allow_callable else ''
    raise ValueError(f'unknown {kind} mode {mode!r}; expected one of {choices}{extra}')


def check_dispatch(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is a known dispatch mode or a callable.

    Example::

        >>> check_dispatch('slice_dp')
        >>> check_dispatch('split')
        Traceback (most recent call last):
        ValueError: unknown dispatch mode 'split'; expected one of 'slice', 'all', 'slice_dp', 'balance' or a callable
    """
    _check_mode('dispatch', mode, DISPATCH_MODES, allow_callable=True)


def check_execute(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`EXECUTE_MODES`.

    Example::

        >>> check_execute('first')
    """
    _check_mode('execute', mode, EXECUTE_MODES, allow_callable=False)


def check_collect(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is a known collect mode or a callable.

    Example::

        >>> check_collect('last_pp')
        >>> check_collect(lambda results, mesh: results[-1])
    """
    _check_mode('collect', mode, COLLECT_MODES, allow_callable=True)
