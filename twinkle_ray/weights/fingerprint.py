"""Content fingerprints of tensors: what ``only_changed`` compares between syncs.

A fingerprint is a real hash of the tensor's raw bytes (BLAKE2b, 128 bits, over the bytes in memory
order, with the dtype and shape mixed in): any changed byte changes it -- one flipped bit, two
blocks that traded places -- and two different contents collide with probability about 2**-128.
It costs one pass over the tensor's bytes (a CUDA tensor is copied to the host in chunks; bounded
extra memory). ``bench/weight_sync.py`` reports its cost per GB beside the sync itself.

>>> import torch
>>> a = torch.ones(5)
>>> fingerprint(a) == fingerprint(a.clone()), fingerprint(a) == fingerprint(a + 1e-7)
(True, False)
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["fingerprint"]

CHUNK_BYTES = 64 << 20  # a device tensor is hashed from host copies of this size


def fingerprint(tensor: Any) -> str:
    """A content fingerprint of ``tensor``: the hex BLAKE2b digest of its dtype, shape and raw bytes."""
    import torch

    x = tensor.detach()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{x.dtype}|{tuple(x.shape)}|".encode())
    if x.numel() == 0:
        return h.hexdigest()
    flat = x.resolve_conj().resolve_neg().contiguous().reshape(-1)  # a conj/neg view: its values
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    if raw.device.type == "cpu":
        h.update(memoryview(raw.numpy()))  # the bytes in place (hashlib drops the GIL for big buffers)
        return h.hexdigest()
    for start in range(0, raw.numel(), CHUNK_BYTES):
        h.update(memoryview(raw[start:start + CHUNK_BYTES].cpu().numpy()))
    return h.hexdigest()
