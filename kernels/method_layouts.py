"""What the OTT, RotateKV and OSCAR kernels read beyond the storage of kernels.ops: exact tokens, RotateKV's tables.

Exact tokens (OTT's outlier pool, RotateKV's attention sinks, OSCAR's sink prefix) are kept in full precision in
a small buffer per row beside the residual window, and their packed copies (their codes are stored too: the
methods quantize every token of a chunk) are skipped by the packed part of decode_attention:

    exact = empty_exact(B, H, ecap, D, cap, dtype, device)
    keys, values [B, H, ecap, D]   the kept tokens (keys in the attention space, like the window's), any order;
    count        [B, H] int32      how many of the ecap slots of each (row, head) hold one (OTT keeps per head);
    skip         [B, H, ceil(cap / 32)] int32   bit t % 32 of word t / 32 set: packed token t is one of them.

The kernel attends [packed tokens whose bit is clear | exact slots < count | window]; a cache keeps each token in
exactly one of the three (a kept token is in the window until the packed count P passes it, then in the exact
buffer with its bit set). Which tokens are kept is the method's: OTT's outlier pool (its state after each key flush,
per head with scope=head), RotateKV's sinks (its state, set at prefill), OSCAR's first sink_tokens positions; their
keys and values are the window's, exact (so the window holds a kept token's own key and value, never its
dequantization). :func:`skip_words` / :func:`skip_mask` convert a boolean mask [..., cap] either way.

RotateKV (kernels/rotatekv.cu rebuilds its keys per position) reads its key codes permuted into the channel order
before the calibrated permutation (:func:`rotatekv_key_layout`), each channel's group (:func:`rotatekv_key_groups`)
and the model's RoPE every ops.ROPE_RUN positions times the rotations by 0 .. ROPE_RUN - 1 (:func:`rotatekv_rope`);
:func:`rotatekv_tables` gives the dict decode_attention's ``rope`` takes.

A cache flushing these methods with their own torch quantizers writes each chunk with :func:`store_packed` and reads
tokens back for the method's dequantize with :func:`load_packed`.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from kernels import ops
from oscar.quant import PackedTensor, pack_bits, unpack_bits
from oscar.transfer import device_ints


def empty_exact(batch: int, heads: int, capacity: int, head_dim: int, packed_capacity: int, dtype: torch.dtype,
                device) -> dict[str, Tensor]:
    """Exact-token storage (module docstring), nothing kept: keys/values [B, H, ecap, D] zeros, count [B, H] and
    skip [B, H, ceil(cap / 32)] int32 zeros."""
    return dict(keys=torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device),
                values=torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device),
                count=torch.zeros(batch, heads, dtype=torch.int32, device=device),
                skip=torch.zeros(batch, heads, math.ceil(packed_capacity / 32), dtype=torch.int32, device=device))


def skip_words(mask: Tensor) -> Tensor:
    """bool [..., n] -> the kernel's skip words int32 [..., ceil(n / 32)] (bit t % 32 of word t / 32 = mask[t])."""
    n = mask.shape[-1]
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, -n % 32)).view(*mask.shape[:-1], -1, 32)
    words = (padded << torch.arange(32, device=mask.device)).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # the uint32 bits as int32


def skip_mask(words: Tensor, n: int) -> Tensor:
    """Inverse of :func:`skip_words`: int32 [..., W] -> bool [..., n]."""
    bits = (words.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=words.device)) & 1
    return bits.flatten(-2)[..., :n].bool()


def rotatekv_key_layout(keys: dict[str, Tensor], bits: int, order: Tensor, inverse: bool = False) -> dict[str, Tensor]:
    """RotateKV's packed keys (codes of z = P H_g k_pre, [B, H, T, D * bits / 8], as the method stores them) with the
    codes moved to the channel order of x = P^T z, what rotatekv.cu reads: row h of the codes holds x's channels
    h D .. h D + D - 1 (or back with ``inverse``); scale/zero (z's groups) unchanged. ``order`` [H * D] is the
    method's permutation (z_j = x_order[j]; torch.arange for reorder=false)."""
    codes = keys["codes"]
    b, h, t, nb = codes.shape
    d = nb * 8 // bits
    if order.shape != (h * d,):
        raise ValueError(f"rotatekv: the channel order must have H * D = {h * d} entries, got {tuple(order.shape)}")
    flat = unpack_bits(codes, bits, d).transpose(1, 2).reshape(b, t, h * d)
    moved = flat[..., _channel_index(order, inverse, codes.device)].reshape(b, t, h, d).transpose(1, 2).contiguous()
    return {**keys, "codes": pack_bits(moved, bits)}


#: (id of a channel order, inverse, device) -> (a weak reference to the order, its index there)
_CHANNEL_INDEX: dict[tuple, tuple[weakref.ref, Tensor]] = {}


def _channel_index(order: Tensor, inverse: bool, device: torch.device) -> Tensor:
    """The index that moves channels to ``order``'s (z = x[order]) or back (x = z[argsort(order)], ``inverse``) on
    ``device``, made once per order and device: a copy from the host at every flush would make the host wait for
    the stream. The weak reference drops the entry when the order is freed (its id may be taken again)."""
    key = (id(order), inverse, torch.device(device))
    hit = _CHANNEL_INDEX.get(key)
    if hit is None or hit[0]() is not order:
        freed = weakref.ref(order, lambda _: _CHANNEL_INDEX.pop(key, None))  # the entry goes with the order
        hit = (freed, (order if inverse else torch.argsort(order)).to(device, copy=True))  # never the order itself
        _CHANNEL_INDEX[key] = hit
    return hit[1]


def rotatekv_key_groups(order: Tensor, group_size: int) -> Tensor:
    """The z group of each of x's channels (x = P^T z): int16 [H * D], argsort(order) // G (groups of all heads)."""
    groups = torch.argsort(order) // group_size
    if int(groups.max()) >= 2**15:
        raise ValueError(f"rotatekv: {int(groups.max()) + 1} key groups per token are more than the kernel indexes")
    return groups.to(torch.int16)


def rotatekv_z_index(order: Tensor) -> Tensor:
    """Where each of x's H * D channels sits in z = P x (z_j = x_order[j]): argsort(order) as int16 [H * D], what
    kernels/rotatekv_keys.cu reads."""
    if order.numel() > 2**15:
        raise ValueError(f"rotatekv: {order.numel()} key channels per token are more than the kernels index")
    return torch.argsort(order).to(torch.int16)


def rotatekv_rope_positions(cos: Tensor, sin: Tensor) -> Tensor:
    """The model's RoPE at positions 0, 1, .. (oscar.rope.rope_tables: cos, sin [P, D], rotate-half, so each half
    repeats) as kernels/rotatekv_keys.cu reads it: [P, D / 2, 2] fp32 (cos, sin of each frequency)."""
    d = cos.shape[-1]
    if not (torch.equal(cos[:, :d // 2], cos[:, d // 2:]) and torch.equal(sin[:, :d // 2], sin[:, d // 2:])):
        raise ValueError("rotatekv: the kernels apply rotate-half RoPE, whose cos/sin repeat over the two halves")
    return torch.stack([cos[:, :d // 2], sin[:, :d // 2]], dim=-1).float().contiguous()


def rotatekv_rope(anchor_cos: Tensor, anchor_sin: Tensor, first_cos: Tensor, first_sin: Tensor) -> dict[str, Tensor]:
    """The RoPE tables of rotatekv.cu from the model's own (rotate-half convention, oscar.rope.rope_tables):
    anchor_cos/anchor_sin [n, D] at positions 0, R, 2 R, .. (R = ops.ROPE_RUN, n >= cap / R), first_cos/first_sin
    [R, D] at positions 0 .. R - 1 -> anchors [n, D / 2, 2] (cos, sin, attention scaling included) and offsets
    [R, D / 2, 2] (cos, sin of d positions: the position-d entries over the scaling, cos at position 0), fp32."""
    d = anchor_cos.shape[-1]
    for table in (anchor_cos, anchor_sin, first_cos, first_sin):
        if not torch.equal(table[..., :d // 2], table[..., d // 2:]):
            raise ValueError("rotatekv: the kernel applies rotate-half RoPE, whose cos/sin repeat over the two halves")
    anchors = torch.stack([anchor_cos[:, :d // 2], anchor_sin[:, :d // 2]], dim=-1).float().contiguous()
    scaling = first_cos[0, :d // 2].double()
    offsets = torch.stack([first_cos[:, :d // 2].double() / scaling, first_sin[:, :d // 2].double() / scaling], dim=-1)
    return dict(anchors=anchors, offsets=offsets.float().contiguous())


def rotatekv_tables(order: Tensor, group_size: int, head_group: int, rope: dict[str, Tensor]) -> dict:
    """decode_attention's ``rope`` for RotateKV: key_group (:func:`rotatekv_key_groups`), anchors and step
    (:func:`rotatekv_rope`), head_group (KV heads per Hadamard group)."""
    return dict(key_group=rotatekv_key_groups(order, group_size).to(rope["anchors"].device), head_group=head_group,
                **rope)


# ----------------------------------------------------------------------------- a method's own chunks <-> storage

#: the storage names of OSCAR's Lloyd-Max parameters (its std and mean sit where the uniform quantizer's scale and
#: zero do: the kernel reads both through its affine code map)
PARAM_NAMES = dict(std="scale", mean="zero")


def _key_layout(name: str, buffers: dict[str, Tensor], bits: int, order: Tensor | None, inverse: bool = False):
    if name == "ott":
        return ops.key_decode_layout(buffers, bits, inverse)
    if name == "rotatekv":
        return rotatekv_key_layout(buffers, bits, order, inverse)
    return ops.token_key_decode_layout(buffers, bits, inverse)


def store_packed(name: str, stream: str, packed: PackedTensor, out: dict[str, Tensor], rows, offsets,
                 order: Tensor | None = None) -> None:
    """Write a chunk the method quantized itself (its quantize_keys / quantize_values PackedTensor, reference layout)
    into the decode-layout storage ``out`` (ops.empty_storage of OTT, RotateKV or OSCAR): chunk row i to storage row
    rows[i] at token offsets[i]. Keys: OTT's per-channel groups (offsets multiples of G), OSCAR's per-token codes
    (ops.token_key_decode_layout; Lloyd-Max's std/mean as scale/zero), RotateKV's (rotatekv_key_layout with
    ``order``); values in the 16-token tiles of ops.value_decode_layout (the tiles a chunk touches are rewritten
    whole, the other tokens in them kept). The chunk's exact/exact_pos are not storage: the caller keeps those
    tokens (empty_exact)."""
    bits, g = packed.meta["bits"], packed.meta["group_size"]
    buffers = {PARAM_NAMES.get(k, k): v for k, v in packed.buffers.items() if k not in ("exact", "exact_pos")}
    t = packed.shape[2]
    if stream == "keys":
        moved = _key_layout(name, buffers, bits, order)
        per_group = packed.meta["axis"] == "channel"
        for i, (row, off) in enumerate(zip(rows, offsets)):
            for key, buf in moved.items():
                lo, n = (off // g, t // g) if per_group and key != "codes" else (off, t)
                out[key][row, :, lo:lo + n] = buf[i]
        return
    if t % 16 == 0 and len(set(offsets)) == 1 and offsets[0] % 16 == 0:  # whole tiles at one offset: no other token
        index, off = device_ints(list(rows), out["codes"].device, torch.long), offsets[0]
        for key, buf in ops.value_decode_layout(buffers, bits, g).items():
            out[key][index, :, off:off + t] = buf
        return
    for i, (row, off) in enumerate(zip(rows, offsets)):
        lo, hi = off // 16 * 16, -(-(off + t) // 16) * 16
        tiles = ops.value_decode_layout({k: out[k][row:row + 1, :, lo:hi] for k in buffers}, bits, g, inverse=True)
        for key, buf in buffers.items():
            tiles[key][0, :, off - lo:off - lo + t] = buf[i]
        for key, buf in ops.value_decode_layout(tiles, bits, g).items():
            out[key][row, :, lo:hi] = buf[0]


def load_packed(name: str, stream: str, store: dict[str, Tensor], rows, start: int, n: int, like: PackedTensor,
                order: Tensor | None = None) -> PackedTensor:
    """Tokens start .. start + n of storage ``rows`` read back into the reference layout: the PackedTensor the
    method's own quantizer returns for them (``like``: one of its chunks, for the names and meta), without exact
    tokens (no exact/exact_pos: the method's dequantize then gives every token from its codes)."""
    bits, g = like.meta["bits"], like.meta["group_size"]
    index = device_ints(list(rows), store["codes"].device, torch.long)
    names = {v: k for k, v in PARAM_NAMES.items() if k in like.buffers}
    h, d = like.shape[1], like.shape[3]
    if stream == "keys" and like.meta["axis"] == "channel":
        chosen = {k: buf[index, :, start // g:(start + n) // g] if k != "codes" else buf[index, :, start:start + n]
                  for k, buf in store.items()}
        buffers = _key_layout(name, chosen, bits, order, inverse=True)
    elif stream == "keys":
        buffers = _key_layout(name, {k: buf[index, :, start:start + n] for k, buf in store.items()}, bits, order,
                              inverse=True)
    else:
        lo, hi = start // 16 * 16, -(-(start + n) // 16) * 16
        tiles = ops.value_decode_layout({k: buf[index, :, lo:hi] for k, buf in store.items()}, bits, g, inverse=True)
        buffers = {k: x[:, :, start - lo:start - lo + n] for k, x in tiles.items()}
    buffers = {names.get(k, k): v for k, v in buffers.items()}
    kept = {k: v for k, v in like.buffers.items() if k in ("exact", "exact_pos")}
    if kept:  # no kept token: S = 0 slots
        buffers.update(exact=kept["exact"].new_zeros(len(index), h, 0, d),
                       exact_pos=kept["exact_pos"].new_zeros(len(index), kept["exact_pos"].shape[1], 0, 1))
    return PackedTensor(buffers, (len(index), h, n, d), like.dtype, dict(like.meta), start)
