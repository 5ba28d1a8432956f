"""tests/cuda_emu.h itself, on small kernels: a block's threads meet at __syncthreads and __syncwarp, exchange values
through the warp shuffles, drop out of barriers when they return early; a read of another thread's write with no
barrier between them finds the old bytes; threads that wait at barriers that cannot complete abort with a message
(every kernel test on the emulator rests on these)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from test_kernels import _ptr, emulator_builder

KERNELS = r"""#include "cuda_emu.h"
// each thread publishes t + 1 in shared memory, then reads the slot of its neighbour at t + step (with or without a
// barrier between)
__global__ void neighbours(unsigned* out, int sync, int step) {
  unsigned* slot = (unsigned*)emu_smem();
  const unsigned t = threadIdx.x, n = blockDim.x;
  slot[t] = t + 1;
  if (sync) __syncthreads();
  out[blockIdx.x * n + t] = slot[(t + n + step) % n];
}
// a butterfly sum over each warp, then the warps' sums through shared memory; threads t >= live return at once
__global__ void warp_sums(unsigned* out, unsigned live) {
  const unsigned t = threadIdx.x;
  if (t >= live) return;
  unsigned v = t * t;
  for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  unsigned* sums = (unsigned*)emu_smem();
  if (t % 32 == 0) sums[t / 32] = v;
  __syncthreads();
  __syncwarp();
  out[t] = __shfl_sync(0xffffffffu, t, 31 - t % 32) + 1000 * sums[(t / 32 + 1) % (live / 32)];
}
// lanes 0-15 of each warp wait at __syncwarp, the others at __syncthreads: neither can complete
__global__ void divergent_barriers() {
  if (threadIdx.x % 32 < 16) __syncwarp();
  else __syncthreads();
}
extern "C" void launch_neighbours(unsigned grid, unsigned block, unsigned* out, int sync, int step) {
  emu_launch({grid, 1, 1}, {block, 1, 1}, 4 * block, [&] { neighbours(out, sync, step); });
}
extern "C" void launch_warp_sums(unsigned block, unsigned* out, unsigned live) {
  emu_launch({1, 1, 1}, {block, 1, 1}, 4 * block / 32, [&] { warp_sums(out, live); });
}
extern "C" void launch_divergent_barriers() {
  emu_launch({1, 1, 1}, {64, 1, 1}, 0, [&] { divergent_barriers(); });
}
"""


@pytest.fixture(scope="module")
def library():
    return emulator_builder(KERNELS)()


@pytest.mark.parametrize("step", [1, -1])
def test_threads_meet_at_syncthreads_in_every_block(library, step):
    out = np.full(3 * 96, 7, dtype=np.uint32)
    library.launch_neighbours(3, 96, _ptr(out), 1, step)
    assert (out.reshape(3, 96) == np.roll(np.arange(1, 97), -step)).all()


@pytest.mark.parametrize("step", [1, -1])
def test_a_read_with_no_barrier_finds_the_old_bytes(library, step):
    """Without the barrier each thread reads its neighbour's slot before or after the neighbour wrote it, by the order
    the emulator resumes threads in, which odd blocks reverse: whichever neighbour a thread reads, nearly every read of
    one of the two blocks finds shared memory's fill (which a kernel test's reference would not)."""
    out = np.full(2 * 96, 7, dtype=np.uint32)
    library.launch_neighbours(2, 96, _ptr(out), 0, step)
    stale = out.reshape(2, 96) != np.roll(np.arange(1, 97), -step)
    assert stale.sum(1).max() >= 95 and (out[stale.ravel()] == 0xCDCDCDCD).all()


@pytest.mark.parametrize("live", [128, 64])
def test_warp_shuffles_and_threads_that_return_early(library, live):
    """Lanes exchange through __shfl_xor_sync and __shfl_sync; with live < blockDim the other threads return before
    any barrier, and the barriers complete without them."""
    out = np.zeros(128, dtype=np.uint32)
    library.launch_warp_sums(128, _ptr(out), live)
    t = np.arange(live)
    warp_sums = (np.arange(128) ** 2).reshape(4, 32).sum(1)[: live // 32]
    expected = (t // 32) * 32 + 31 - t % 32 + 1000 * warp_sums[(t // 32 + 1) % (live // 32)]
    assert (out[:live] == expected).all() and (out[live:] == 0).all()


def test_threads_waiting_at_barriers_that_cannot_complete_abort_with_a_message(library):
    """A deadlock in a kernel ends the process (the test runs it in a child) with the block named, not a hang."""
    path = library._name  # built by the fixture: the child loads it
    child = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({path!r}).launch_divergent_barriers()"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode != 0
    assert "block 0's threads all wait at barriers that cannot complete" in child.stderr
