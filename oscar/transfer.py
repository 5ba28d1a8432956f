"""Host-to-device copies that leave the stream running: a list of row indices or counts made on the host becomes a
device tensor without the host waiting for the GPU."""

from __future__ import annotations

import contextlib

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
_shared: dict[tuple, Tensor] | None = None  # while :func:`shared_ints` is open: the lists already sent


@contextlib.contextmanager
def shared_ints():
    """Within it, :func:`device_ints` sends each distinct list once and hands the same device tensor to every caller
    that asks for it again (the layers of one step index the same rows: one copy instead of one per layer). Callers
    only read what they get. Nested uses share the outermost one's tensors."""
    global _shared
    if _shared is not None:
        yield
        return
    _shared = {}
    try:
        yield
    finally:
        _shared = None


def device_ints(values, device, dtype: torch.dtype = torch.int32) -> Tensor:
    """A host list of ints as a tensor on ``device``, without a stream sync on a GPU: staged in pinned memory
    (a :class:`PinnedRing` per device, stream and dtype) and copied asynchronously (torch.tensor(list, device="cuda")
    waits for the stream to drain, which, once per layer and call of a chunked prefill, keeps the host from running
    ahead of the GPU). Not inside a CUDA-graph capture (the graph would keep reading the staging buffer)."""
    device = torch.device(device)
    if _shared is None:
        return _send(values, device, dtype)
    key = (tuple(values), device, dtype)
    sent = _shared.get(key)
    if sent is None:
        sent = _shared[key] = _send(values, device, dtype)
    return sent


def _send(values, device: torch.device, dtype: torch.dtype) -> Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype).to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("device_ints copies from host memory: not inside a CUDA-graph capture")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # the current stream's id, as torch.cuda.current_stream reads it (without building a Stream object every call)
    stream_id, index, _ = torch._C._cuda_getCurrentStream(index)
    key = (index, stream_id, dtype)
    ring = _rings.get(key)
    if ring is None:
        ring = _rings[key] = PinnedRing(dtype, torch.cuda.current_stream(device))
    if len(values) > ring.segment:
        return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
    return ring.stage(values).to(device, non_blocking=True)
