"""Weight sync trainer -> samplers, resharded: every trainer rank sends only what it holds, every
receiver gets only what it keeps, the plan is computed once and replayed, and samplers come and go.

One module per job:

- :mod:`~twinkle_ray.weights.driver`: :func:`sync_weights`, :class:`WeightSync` (the driver API);
- :mod:`~twinkle_ray.weights.handle`: :class:`SyncHandle` (a sync under way, and how it fails);
- :mod:`~twinkle_ray.weights.mixin`: :class:`WeightSyncMixin` (the worker side, trainer and sampler);
- :mod:`~twinkle_ray.weights.layout`: :class:`Slab`, :class:`Want` (what each end holds or keeps);
- :mod:`~twinkle_ray.weights.plan`: the transfer plan (who sends which rows to whom);
- :mod:`~twinkle_ray.weights.transport`: endpoints and point-to-point pairs (gloo / NCCL);
- :mod:`~twinkle_ray.weights.sender`, :mod:`~twinkle_ray.weights.receiver`: one sync at either end;
- :mod:`~twinkle_ray.weights.fingerprint`: content fingerprints for ``only_changed``.

Example::

    @remote_class()
    class Trainer(WeightSyncMixin):
        def __init__(self, device_mesh=None):
            self.model = build_model()          # weight_sync_shards() sends self.model's own tensors

    @remote_class()
    class Sampler(WeightSyncMixin):
        def __init__(self, device_mesh=None):
            self.model = build_model()          # received tensors are copied into self.model

    stats = sync_weights(trainer, sampler)              # sets up once, then replays the plan
    stats = sync_weights(trainer, sampler, only_changed=True)
    handle = sync_weights(trainer, sampler, wait=False) # in both gangs' call order; twinkle_ray.get(handle)
"""

from .driver import WeightSync, sync_weights
from .fingerprint import fingerprint
from .handle import SyncHandle
from .layout import Slab, TensorSource, Want, fused_slabs
from .mixin import WeightSyncMixin
from .receiver import ReceiverEnd, load_into
from .transport import VLLM_NCCL, PeerFailed, SetupRefused, SourceFailed, SyncStats, choose_backend

__all__ = ["VLLM_NCCL", "PeerFailed", "ReceiverEnd", "SetupRefused", "Slab", "SourceFailed", "SyncHandle",
           "SyncStats", "TensorSource", "Want", "WeightSync", "WeightSyncMixin", "choose_backend", "fingerprint",
           "fused_slabs", "load_into", "sync_weights"]
