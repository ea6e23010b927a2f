"""The few CPU workarounds Megatron-Core 0.16.1 needs to train on CPU with gloo (no GPU, no CUDA torch).

    from examples.vllm_megatron.megatron_cpu import cpu_megatron, seed_model_parallel

    with cpu_megatron(active=device.type == "cpu"):   # a no-op context on CUDA
        parallel_state.initialize_model_parallel(...)
        seed_model_parallel(seed)                      # W2
        model = GPTModel(...)                          # W3 (rotary, buffers), W8 (tied embeddings, PP)
        get_forward_backward_func()(...)               # W3 (p2p buffers), W4 (schedule counters)
        optimizer.step()                               # W4 (found_inf, norms), W7 (clip_grads' type check)

Megatron-Core is written for CUDA. Each workaround below names the Megatron
site it covers (megatron-core 0.16.1); all of them are undone when the
context exits, and none is installed on CUDA (``active=False``):

- **W2** ``tensor_parallel.random.model_parallel_cuda_manual_seed`` adds CUDA
  RNG states (``torch.cuda.get_rng_state``) to its tracker, and attention
  always forks that tracker. :func:`seed_model_parallel` asks for the
  inference tracker (its ``add``/``fork`` keep no CUDA state) and seeds the CPU
  generator instead. Exact because the trainer builds with dropout 0 and
  ``use_cpu_initialization=True`` (weights come from the HF checkpoint anyway).
- **W3** ``torch.cuda.current_device()``: the device of rotary embeddings
  (``RotaryEmbedding.forward``), TP/PP buffers (``GlobalMemoryBuffer.get_tensor``,
  ``p2p_communication._communicate``), DDP grad buffers
  (``_ParamAndGradBuffer``) and the optimizer's constants. Inside the context
  it returns the CPU device.
- **W4** literal ``device="cuda"`` / ``.cuda()``: ``schedules.py``
  (``total_num_tokens``), ``optimizer.py`` (``found_inf``, ``_scale_one``),
  ``clip_grads.py`` (norm buffers), and **W8**
  ``LanguageModule.setup_embeddings_and_output_layer`` (``weight.data.cuda()``
  for tied embeddings with PP > 1). A :class:`torch.overrides.TorchFunctionMode`
  maps every CUDA device argument to the CPU and makes ``Tensor.cuda()`` the
  identity while the context is open.
- **W5** ``torch.cuda.synchronize()`` in ``p2p_communication`` is skipped by
  the trainer's config (``batch_p2p_sync=False``), not here.
- **W7** ``clip_grads.clip_grad_by_total_norm_fp32`` asserts
  ``grad.type() == 'torch.cuda.FloatTensor'``: inside the context,
  ``Tensor.type()`` (no argument) of a CPU tensor reports the CUDA type name,
  so Megatron's gradient clipping runs as written.

W1 (triton via ``moe/ops/paged_stash.py``) and W6 (DDP's
``torch.cuda.current_stream``) of the reference table are not met on
0.16.1 with the trainer's settings (no such import; DDP uses streams only
with several distributed-optimizer instances), so nothing is installed for
them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["cpu_megatron", "seed_model_parallel"]


def _is_cuda(device: Any) -> bool:
    """Whether a device argument names a CUDA device ('cuda', 'cuda:0', torch.device('cuda'), 0)."""
    import torch

    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _mode_class() -> type:
    """W4 + W7 + W8: the TorchFunctionMode (built lazily: importing this module needs no torch)."""
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")

    class CudaToCpu(TorchFunctionMode):
        """Maps CUDA device arguments to the CPU; ``.cuda()`` is the identity; ``.type()`` says cuda."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:  # W4 / W8
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # W7
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            if "device" in kwargs and _is_cuda(kwargs["device"]):  # W4: torch.zeros(..., device="cuda")
                kwargs["device"] = cpu
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]) and not isinstance(args[1], int):
                args = (args[0], cpu, *args[2:])  # W4: t.to("cuda")
            return func(*args, **kwargs)

    return CudaToCpu


@contextmanager
def cpu_megatron(active: bool = True) -> Iterator[None]:
    """W3 + W4 + W7 + W8 while Megatron-Core runs on the CPU; nothing at all when ``active`` is False.

    >>> with cpu_megatron(active=False):   # on CUDA: a no-op
    ...     pass
    """
    if not active:
        yield
        return
    import torch

    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # W3 (restored below)
    try:
        with _mode_class()():
            yield
    finally:
        torch.cuda.current_device = saved


def seed_model_parallel(seed: int, cpu: bool) -> None:
    """Megatron's model-parallel seeding; on CPU (W2) without CUDA RNG states.

    >>> # after initialize_model_parallel: seed_model_parallel(0, cpu=True)
    """
    import torch
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu, force_reset_rng=True)
