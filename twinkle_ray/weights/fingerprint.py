"""Content fingerprints of tensors: what ``only_changed`` compares between syncs.

A fingerprint is (numel, a 64-bit randomised sum over the tensor's raw bits): any one changed
element changes it; two different contents collide with probability about 2**-64. It costs one
pass over the tensor on its own device, in chunks (bounded extra memory).

>>> import torch
>>> a = torch.ones(5)
>>> fingerprint(a) == fingerprint(a.clone()), fingerprint(a) == fingerprint(a + 1e-7)
(True, False)
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["fingerprint"]

CHUNK = 1 << 20
_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


@lru_cache(maxsize=8)
def _odd_weights(device: str) -> Any:
    """The fixed odd random weights of the sum, one copy per device (not a channel: a constant)."""
    import torch

    gen = torch.Generator().manual_seed(0x7A1E)
    w = torch.randint(-(2**62), 2**62, (CHUNK,), generator=gen, dtype=torch.int64) | 1
    return w.to(device)


def fingerprint(tensor: Any) -> tuple[int, int]:
    """A content fingerprint of ``tensor``'s raw bits: (numel, randomised sum mod 2**64)."""
    import torch

    x = tensor.detach().reshape(-1)
    if x.numel() == 0:
        return (0, 0)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    bits = x.contiguous().view(getattr(torch, _INT_VIEW[x.element_size()]))
    w = _odd_weights(str(bits.device))
    # Odd random weights: any single changed element changes the sum; int64 wraps mod 2**64.
    mixed = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), CHUNK):
        chunk = bits[start:start + CHUNK].to(torch.int64)
        mixed += (chunk * w[: chunk.numel()]).sum()
    return (int(bits.numel()), int(mixed))
