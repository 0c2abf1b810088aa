"""The merged CPU path: base + delta is merged (common.merge_layer) and packed into a new oneDNN
/ AMX handle, so generation afterwards runs at exactly base speed."""

from __future__ import annotations

import torch

from .common import _Packed


def pack_cpu(weight: torch.Tensor) -> _Packed:
    """Build a packed CPU GEMM for ``weight`` (N, K) without touching any live layer.

    Runs vLLM's own load-time dispatch on a throwaway module, so the kernel choice (oneDNN,
    AMX "sgl" for small weights, zentorch, plain F.linear fallback) is exactly vLLM's. The
    throwaway has no bias: the closure takes bias at call time from the live layer, whose bias
    vLLM already converted at load; giving it the live bias would let the sgl path mutate it.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    holder.bias = None
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    return _Packed(holder.cpu_linear, holder.weight)
