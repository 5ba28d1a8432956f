"""Flush policies: how many of a stream's tokens are packed once T tokens are stored (pure bookkeeping).

A cache keeps, per row and per stream (keys, values), a packed part followed by a full-precision window of the
most recent tokens; a policy says how long the packed part is after T tokens. Every cache (the reference
``oscar.cache``, the engine's torch static cache ``oscar.static_cache`` and the CuPy cache ``kernels.backend``)
consults the same object, so a new policy is one class here:

    policy  keys packed after T tokens       values packed after T tokens
    kivi    T - T mod R (windows of R keys)  max(0, T - R) (exactly the last R values stay)
    block   T - T mod R                      T - T mod R (both flush whole windows: OScaR's reference)
    window  max(0, T - R)                    max(0, T - R) (both keep exactly the last R: OSCAR's recent window)

R = 0 packs every token. Counts only grow with T, and tokens once packed are never re-quantized: a cache flushes
``keys_packed(T) - keys_packed(T_before)`` tokens when it reaches T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Flush:
    """A policy for a residual window of ``residual_length`` (R) tokens."""

    name: ClassVar[str] = "base"
    #: values leave the window one token at a time (every step past R), not in whole windows
    values_slide: ClassVar[bool] = False
    #: keys leave the window one token at a time (per-token key groups only)
    keys_slide: ClassVar[bool] = False

    residual_length: int

    def __post_init__(self) -> None:
        if self.residual_length < 0:
            raise ValueError(f"residual_length must be >= 0, got {self.residual_length}")

    def _windows(self, tokens: int) -> int:
        r = self.residual_length
        return tokens if r == 0 else tokens - tokens % r

    def _sliding(self, tokens: int) -> int:
        return max(0, tokens - self.residual_length)

    def keys_packed(self, tokens: int) -> int:
        return self._sliding(tokens) if self.keys_slide else self._windows(tokens)

    def values_packed(self, tokens: int) -> int:
        return self._sliding(tokens) if self.values_slide else self._windows(tokens)

    def packed(self, tokens: int) -> tuple[int, int]:
        """(keys, values) packed after ``tokens`` stored tokens."""
        return self.keys_packed(tokens), self.values_packed(tokens)

    @property
    def key_window(self) -> int:
        """Raw keys a window holds at most: R, or R + 1 for sliding keys (the step's token is stored before the
        oldest leaves); at least 1 (R = 0 still holds the step's token until it is flushed)."""
        return max(1, self.residual_length) + self.keys_slide


@dataclass(frozen=True)
class KiviFlush(Flush):
    """KIVI: keys flush whole windows of R, values keep exactly the last R."""

    name: ClassVar[str] = "kivi"
    values_slide: ClassVar[bool] = True


@dataclass(frozen=True)
class BlockFlush(Flush):
    """OScaR's reference: keys and values both flush whole windows of R."""

    name: ClassVar[str] = "block"


@dataclass(frozen=True)
class WindowFlush(Flush):
    """OSCAR's recent window: keys and values both keep exactly the last R (per-token key groups only)."""

    name: ClassVar[str] = "window"
    values_slide: ClassVar[bool] = True
    keys_slide: ClassVar[bool] = True


FLUSH_POLICIES: dict[str, type[Flush]] = {cls.name: cls for cls in (KiviFlush, BlockFlush, WindowFlush)}


def flush_policy(name: str, residual_length: int) -> Flush:
    """The policy ``name`` (a method's ``flush`` field) for a window of ``residual_length`` tokens."""
    if name not in FLUSH_POLICIES:
        raise ValueError(f"unknown flush policy {name!r}; available: {', '.join(FLUSH_POLICIES)}")
    return FLUSH_POLICIES[name](residual_length)
