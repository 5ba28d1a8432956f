"""Host-to-device copies that leave the stream running: a list of row indices or counts made on the host becomes a
device tensor without the host waiting for the GPU."""

from __future__ import annotations

import torch
from torch import Tensor


class PinnedRing:
    """Pinned host memory that :func:`device_ints` stages its lists in, reused in turn: ``segments`` segments of
    ``segment`` entries of one dtype, for the copies queued on one stream. A list goes to the segment in use; one that
    does not fit moves on to the next, after an event recorded on the stream marks the segment left. A segment is
    written again only once the event recorded when it was last left has passed (the copies queued from it are done):
    the host waits there only if the GPU is a whole ring of copies behind. Allocating pinned memory per list
    (``Tensor.pin_memory``) costs more host time than the copy it serves (tens of microseconds, on every layer of a
    step)."""

    def __init__(self, dtype: torch.dtype, stream: torch.cuda.Stream, segments: int = 8, segment: int = 4096):
        self.stream, self.segment = stream, segment
        self.host = torch.empty(segments * segment, dtype=dtype, pin_memory=True)
        self.entries = self.host.numpy()
        self.left: list[torch.cuda.Event | None] = [None] * segments  # per segment: the event of its last leaving
        self.current, self.used = 0, 0

    def stage(self, values) -> Tensor:
        """``values`` (at most ``segment`` of them) in pinned memory: a view the caller copies on the ring's stream
        before the next call."""
        n = len(values)
        if self.used + n > self.segment:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.left[self.current] = event
            self.current, self.used = (self.current + 1) % len(self.left), 0
            if self.left[self.current] is not None:
                self.left[self.current].synchronize()
        start = self.current * self.segment + self.used
        self.entries[start:start + n] = values
        self.used += n
        return self.host[start:start + n]


_rings: dict[tuple, PinnedRing] = {}


def device_ints(values, device, dtype: torch.dtype = torch.int32) -> Tensor:
    """A host list of ints as a tensor on ``device``, without a stream sync on a GPU: staged in pinned memory
    (a :class:`PinnedRing` per device, stream and dtype) and copied asynchronously (torch.tensor(list, device="cuda")
    waits for the stream to drain, which, once per layer and call of a chunked prefill, keeps the host from running
    ahead of the GPU). Not inside a CUDA-graph capture (the graph would keep reading the staging buffer)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype).to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("device_ints copies from host memory: not inside a CUDA-graph capture")
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.stream_id, dtype)
    ring = _rings.get(key)
    if ring is None:
        ring = _rings[key] = PinnedRing(dtype, stream)
    if len(values) > ring.segment:
        return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
    return ring.stage(values).to(device, non_blocking=True)
