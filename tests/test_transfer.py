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


def test_within_shared_ints_a_list_is_sent_once_and_distinct_lists_apart(monkeypatch):
    import oscar.transfer as transfer
    sent = []
    real = transfer._send
    monkeypatch.setattr(transfer, "_send", lambda values, device, dtype: sent.append(list(values)) or real(
        values, device, dtype))
    with transfer.shared_ints():
        first = device_ints([4, 1, 2], "cpu", torch.long)
        with transfer.shared_ints():  # nested: the outer one's tensors
            again = device_ints((4, 1, 2), "cpu", torch.long)
        other_dtype = device_ints([4, 1, 2], "cpu")
        other_values = device_ints([4, 1], "cpu", torch.long)
    assert again is first and first.tolist() == [4, 1, 2]
    assert other_dtype.dtype == torch.int32 and other_values.tolist() == [4, 1]
    assert sent == [[4, 1, 2], [4, 1, 2], [4, 1]]
    device_ints([4, 1, 2], "cpu", torch.long)  # closed: every call sends again
    assert len(sent) == 4
