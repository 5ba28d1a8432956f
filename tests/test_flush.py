"""oscar.flush: the flush policies as pure bookkeeping over token counts, against a table of cases, and the rule
every cache relies on (counts never fall, at most a window of R tokens stays unpacked)."""

from __future__ import annotations

import pytest

from oscar import build_method
from oscar.flush import FLUSH_POLICIES, flush_policy
from oscar.method import FlushPolicy

#: (policy, R, tokens stored) -> (keys packed, values packed)
CASES = [
    ("kivi", 128, 0, (0, 0)), ("kivi", 128, 127, (0, 0)), ("kivi", 128, 128, (128, 0)),
    ("kivi", 128, 129, (128, 1)), ("kivi", 128, 300, (256, 172)), ("kivi", 0, 5, (5, 5)),
    ("block", 128, 127, (0, 0)), ("block", 128, 128, (128, 128)), ("block", 128, 300, (256, 256)),
    ("block", 0, 7, (7, 7)), ("block", 32, 2048, (2048, 2048)),
    ("window", 256, 255, (0, 0)), ("window", 256, 300, (44, 44)), ("window", 0, 9, (9, 9)),
]


@pytest.mark.parametrize("name, r, tokens, packed", CASES)
def test_packed_counts(name, r, tokens, packed):
    assert flush_policy(name, r).packed(tokens) == packed


@pytest.mark.parametrize("name", FLUSH_POLICIES)
@pytest.mark.parametrize("r", [0, 1, 32, 128])
def test_counts_grow_and_leave_at_most_a_window(name, r):
    policy = flush_policy(name, r)
    before = (0, 0)
    for tokens in range(600):
        now = policy.packed(tokens)
        assert all(a <= b <= tokens for a, b in zip(before, now))  # never re-quantized, never past the stream
        assert all(tokens - n <= r for n in now), (tokens, now)  # at most R tokens wait in a window
        before = now
    assert policy.key_window == max(1, r) + (name == "window")


def test_the_method_field_names_every_policy_and_methods_consult_it():
    assert set(FlushPolicy.__args__) == set(FLUSH_POLICIES)
    assert build_method("oscar").flush_policy == flush_policy("block", 128)
    assert build_method("kivi", residual_length=64).flush_policy.packed(100) == (64, 36)
    with pytest.raises(ValueError, match="unknown flush policy 'fifo'"):
        flush_policy("fifo", 8)
