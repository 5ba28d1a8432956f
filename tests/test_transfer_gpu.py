"""oscar.transfer on a GPU: device_ints' lists reach the device intact while the GPU runs behind the host, through
every segment of its pinned ring and around it again, on the default stream and a side stream, for lists longer
than a segment too; the host waits only when the GPU is a whole ring behind. The CPU half: tests/test_transfer.py."""

from __future__ import annotations

import random

import pytest
import torch

from oscar import transfer
from oscar.transfer import device_ints
from tests.test_kernels import _gpu_ready

gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and CuPy")
pytestmark = [pytest.mark.gpu, gpu]


def _lists(seed: int, count: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(1, longest))] for _ in range(count)]


@pytest.mark.parametrize("side_stream", [False, True])
def test_lists_arrive_intact_around_the_ring_while_the_gpu_lags(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        ring = transfer.PinnedRing(torch.int32, stream, segments=3, segment=64)
        transfer._rings[(stream.device_index, stream.stream_id, torch.int32)] = ring
        try:
            lists = _lists(0, 40, 60)  # about 20 segments' worth: the ring comes round six times
            torch.cuda._sleep(50_000_000)  # the copies queue behind a long kernel
            got = [device_ints(values, "cuda") for values in lists]
            long = _lists(1, 1, 300)[0] + list(range(200))  # longer than a segment: staged on its own
            got_long = device_ints(long, "cuda", torch.long)
            torch.cuda.synchronize()
        finally:
            transfer._rings.pop((stream.device_index, stream.stream_id, torch.int32))
    for values, tensor in zip(lists, got):
        assert tensor.dtype == torch.int32 and tensor.device.type == "cuda"
        assert tensor.tolist() == values
    assert got_long.dtype == torch.long and got_long.tolist() == long
    assert all(event is not None for event in ring.left), "every segment was left at least once"


def test_the_host_runs_ahead_until_a_whole_ring_is_queued():
    """Lists that fit in the ring's segments queue without a host wait behind a long kernel."""
    stream = torch.cuda.current_stream()
    ring = transfer.PinnedRing(torch.int32, stream, segments=4, segment=16)
    transfer._rings[(stream.device_index, stream.stream_id, torch.int32)] = ring
    try:
        torch.cuda._sleep(200_000_000)
        for i in range(3):  # three lists fill three of the four segments: no wait yet
            device_ints(list(range(i, i + 16)), "cuda")
        assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
        torch.cuda.synchronize()
    finally:
        transfer._rings.pop((stream.device_index, stream.stream_id, torch.int32))


def test_not_inside_a_graph_capture():
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with torch.cuda.graph(graph):
            device_ints([1, 2, 3], "cuda")


def test_within_shared_ints_each_list_is_copied_once_and_arrives_intact():
    lists = _lists(2, 10, 40)
    with transfer.shared_ints():
        torch.cuda._sleep(50_000_000)  # the copies queue behind a long kernel
        got = [device_ints(values, "cuda") for values in lists + lists]
    torch.cuda.synchronize()
    assert all(first is again for first, again in zip(got[:10], got[10:]))
    assert [tensor.tolist() for tensor in got[:10]] == lists
