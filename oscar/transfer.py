"""Host-to-device copies that leave the stream running: a list of row indices or counts made on the host becomes a
device tensor without the host waiting for the GPU."""

from __future__ import annotations

import torch
from torch import Tensor


def device_ints(values, device, dtype: torch.dtype = torch.int32) -> Tensor:
    """A host list of ints as a tensor on ``device``, without a stream sync on a GPU: staged in pinned memory and
    copied asynchronously (torch.tensor(list, device="cuda") waits for the stream to drain, which, once per layer
    and call of a chunked prefill, keeps the host from running ahead of the GPU). Not inside a CUDA-graph capture
    (the graph would keep reading the staging buffer)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("device_ints copies from host memory: not inside a CUDA-graph capture")
    return host.pin_memory().to(device, non_blocking=True)
