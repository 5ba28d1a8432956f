"""oscar.transfer on the CPU: device_ints gives the list in the dtype asked (its GPU path, a pinned ring queued
behind the GPU's work: tests/test_transfer_gpu.py)."""

from __future__ import annotations

import torch

from oscar.transfer import device_ints


def test_a_list_comes_back_in_the_dtype_asked():
    values = [3, -1, 2**31 - 1, 0, 7]
    got = device_ints(values, "cpu")
    assert got.dtype == torch.int32 and got.tolist() == values
    wide = device_ints(values + [2**40], torch.device("cpu"), torch.long)
    assert wide.dtype == torch.long and wide.tolist() == values + [2**40]
    assert device_ints([], "cpu").shape == (0,)
