"""OScaR over paged storage: one layer's packed pages (vLLM's KV-cache blocks) plus a residual window per request.

This is the project's ``block`` flush policy with the residual length R equal to the block size B: a request's
full blocks are packed (:class:`oscar_vllm.layout.PageLayout`), the tokens of its last, partial block are kept in
full precision in a residual window (keys rotated, as the decode kernel reads them), and a block is quantized as
a whole when its last token arrives (``tokens - tokens % R`` flushed, exactly like ``oscar.cache``). What
attention sees follows the project's cache (``quantize_prefill=False``): the tokens of the current step in full
precision plus the older tokens as stored; the flush happens after attention.

Values are rotated here (v' = H v per head before storing, out = H out' after attention) instead of folding H
into v_proj/o_proj: vLLM loads the weights itself, and the two are equal in exact arithmetic (the fold rounds
the weights once, this rounds v' and out' in the model dtype). OScaR's token norm is taken over the KV heads of
this process: with tensor parallelism it is a per-rank norm (the reference's at TP=1).

On CUDA the quantizers and the decode attention are the project's kernels (``kernels.ops.quantize_keys``,
``quantize_values``, ``decode_attention``); on a CPU their torch references (``methods.oscar.OScaR`` and
``kernels.reference.oscar_decode``), so every step of the bookkeeping runs in the CPU tests.

Shapes: per request i of a step, ``starts[i]`` tokens are already cached and ``query_lens[i]`` new tokens come
(decodes first, vLLM's order); ``slots[i]`` is its residual window (vLLM's request index); ``block_table`` [r, n]
its page ids; query [T, Hq, D], key/value [T, H, D] concatenated over requests; the output [T, Hq, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from oscar.method import build_method
from oscar.quant import hadamard
from oscar_vllm.layout import PageLayout


class PagedOScaR:
    """One layer: packed pages (owned by the caller, vLLM) and ``num_slots`` residual windows (owned here)."""

    def __init__(self, layout: PageLayout, num_slots: int, scaling: float, device=None):
        self.layout = layout
        self.scaling = scaling
        b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
        #: residual windows [slots, H, B, D] in the model dtype: keys rotated, values rotated (v' = H v)
        self.key_residual = torch.zeros(num_slots, h, b, d, dtype=layout.dtype, device=device)
        self.value_residual = torch.zeros(num_slots, h, b, d, dtype=layout.dtype, device=device)
        # the CPU quantizer and the dequantizer: OScaR on keys that are already rotated (rotate=False)
        self.method = build_method("oscar", k_bits=layout.k_bits, v_bits=layout.v_bits, group_size=layout.group_size,
                                   residual_length=b, rotate=False)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residual windows (allocated once, outside vLLM's pages)."""
        return sum(x.numel() * x.element_size() for x in (self.key_residual, self.value_residual))

    # ------------------------------------------------------------------------------------------- one step

    def forward(self, pages: Tensor, query: Tensor, key: Tensor, value: Tensor, starts: list[int],
                query_lens: list[int], slots: list[int], block_table: Tensor) -> Tensor:
        """Attend every new token over its request's cache and itself, then store the new tokens."""
        if not (len(starts) == len(query_lens) == len(slots) == block_table.shape[0]):
            raise ValueError("starts, query_lens, slots and block_table need one entry per request")
        if sum(query_lens) != query.shape[0]:
            raise ValueError(f"query_lens add up to {sum(query_lens)} tokens, the step has {query.shape[0]}")
        if slots and not 0 <= min(slots) <= max(slots) < self.key_residual.shape[0]:
            raise ValueError(f"request slots {slots} outside the {self.key_residual.shape[0]} residual windows")
        out = torch.empty_like(query)
        decodes = 0
        while decodes < len(query_lens) and query_lens[decodes] == 1:
            decodes += 1
        if decodes:
            out[:decodes] = self._decode(pages, query[:decodes], key[:decodes], value[:decodes], starts[:decodes],
                                         slots[:decodes], block_table[:decodes])
        at = decodes
        for i in range(decodes, len(query_lens)):
            n = query_lens[i]
            out[at:at + n] = self._prefill(pages, query[at:at + n], key[at:at + n], value[at:at + n], starts[i],
                                           slots[i], block_table[i])
            at += n
        return out

    def _decode(self, pages: Tensor, query: Tensor, key: Tensor, value: Tensor, starts: list[int],
                slots: list[int], block_table: Tensor) -> Tensor:
        """One new token per request: into the residual window, attention over [pages | window], then the flush
        of the windows that became full."""
        b = self.layout.block_size
        device = query.device
        slot = torch.tensor(slots, dtype=torch.long, device=device)
        offset = torch.tensor([s % b for s in starts], dtype=torch.long, device=device)
        self.key_residual[slot, :, offset] = hadamard(key)
        self.value_residual[slot, :, offset] = hadamard(value)
        full_blocks = [s // b for s in starts]
        n_packed = torch.tensor([n * b for n in full_blocks], dtype=torch.int32, device=device)
        n_residual = (offset + 1).to(torch.int32)
        # at least one page per row so the storage is never empty; rows with n_packed = 0 read none of it
        keys, values = self.layout.gather(pages, block_table[:, :max(1, max(full_blocks))])
        out = self._attend_packed(query.unsqueeze(2), keys, values, self.key_residual[slot],
                                  self.value_residual[slot], n_packed, n_residual, max(full_blocks) * b)
        full = [i for i, s in enumerate(starts) if s % b == b - 1]
        if full:
            rows = torch.tensor(full, dtype=torch.long, device=device)
            self._flush(pages, self.key_residual[slot[rows]], self.value_residual[slot[rows]],
                        block_table[rows, torch.tensor([full_blocks[i] for i in full], device=block_table.device)])
        return hadamard(out.squeeze(2))

    def _prefill(self, pages: Tensor, query: Tensor, key: Tensor, value: Tensor, start: int, slot: int,
                 block_row: Tensor) -> Tensor:
        """A chunk of one request: causal attention over [stored context | chunk in full precision], then the
        chunk's whole blocks are quantized and its tail kept in the residual window."""
        b, h = self.layout.block_size, self.layout.num_kv_heads
        n_new, stored_blocks, kept = query.shape[0], start // b, start % b
        k_new, v_new = hadamard(key).transpose(0, 1), hadamard(value).transpose(0, 1)  # [H, n, D]
        k_old, v_old = self._stored(pages, block_row[:stored_blocks])
        k_all = torch.cat([k_old, self.key_residual[slot, :, :kept], k_new], dim=1)
        v_all = torch.cat([v_old, self.value_residual[slot, :, :kept], v_new], dim=1)
        q = hadamard(query).transpose(0, 1)  # [Hq, n, D]
        seen = torch.arange(start + n_new, device=query.device)
        mask = seen[None, :] <= (start + torch.arange(n_new, device=query.device))[:, None]
        rep = q.shape[0] // h
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k_all.repeat_interleave(rep, 0).unsqueeze(0),
                                             v_all.repeat_interleave(rep, 0).unsqueeze(0), attn_mask=mask,
                                             scale=self.scaling)[0]
        # store: [residual window | chunk] -> whole blocks to the pages, the rest back into the window
        k_win, v_win = k_all[:, stored_blocks * b:], v_all[:, stored_blocks * b:]
        whole = k_win.shape[1] // b
        if whole:
            k_blocks = k_win[:, :whole * b].reshape(h, whole, b, -1).transpose(0, 1)
            v_blocks = v_win[:, :whole * b].reshape(h, whole, b, -1).transpose(0, 1)
            self._flush(pages, k_blocks, v_blocks, block_row[stored_blocks:stored_blocks + whole])
        tail = k_win.shape[1] - whole * b
        self.key_residual[slot, :, :tail] = k_win[:, whole * b:]
        self.value_residual[slot, :, :tail] = v_win[:, whole * b:]
        return hadamard(out.transpose(0, 1))

    # ------------------------------------------------------------------------------------------- pieces

    def _stored(self, pages: Tensor, block_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The packed tokens of these pages dequantized (rotated space, model dtype): [H, n*B, D] each."""
        if block_ids.numel() == 0:
            lay = self.layout
            empty = torch.empty(lay.num_kv_heads, 0, lay.head_dim, dtype=lay.dtype, device=pages.device)
            return empty, empty
        keys, values = self.layout.gather(pages, block_ids.reshape(1, -1))
        packed_keys, packed_values = self.layout.packed_tensors(keys, values)
        return self.method.dequantize(packed_keys)[0], self.method.dequantize(packed_values)[0]

    def quantize(self, k_rot: Tensor, v_rot: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Whole blocks [n, H, B, D] (keys and values rotated) -> packed buffers in the decode layouts."""
        lay = self.layout
        if k_rot.is_cuda:
            from kernels import ops

            keys = ops.quantize_keys(k_rot, lay.k_bits, lay.group_size, rotate=False, decode_layout=True)
            values = ops.quantize_values(v_rot, lay.v_bits, lay.group_size, decode_layout=True)
            return keys.buffers, values.buffers
        from kernels.ops import key_decode_layout, value_decode_layout

        keys = key_decode_layout(self.method.quantize_keys(k_rot, 0).buffers, lay.k_bits)
        values = value_decode_layout(self.method.quantize_values(v_rot, 0).buffers, lay.v_bits, lay.group_size)
        return keys, values

    def _flush(self, pages: Tensor, k_rot: Tensor, v_rot: Tensor, block_ids: Tensor) -> None:
        keys, values = self.quantize(k_rot.contiguous(), v_rot.contiguous())
        self.layout.write(pages, block_ids, keys, values)

    def _attend_packed(self, query: Tensor, keys: dict, values: dict, key_residual: Tensor, value_residual: Tensor,
                       n_packed: Tensor, n_residual: Tensor, max_packed: int) -> Tensor:
        """query [r, Hq, 1, D] over its packed + residual tokens -> [r, Hq, 1, D] in the rotated value space."""
        lay = self.layout
        if query.is_cuda:
            from kernels import ops

            return ops.decode_attention(query, keys, values, key_residual, value_residual, n_packed, n_residual,
                                        k_bits=lay.k_bits, v_bits=lay.v_bits, group_size=lay.group_size,
                                        scaling=self.scaling, method="oscar", max_packed=max_packed)
        from kernels.reference import oscar_decode

        packed_keys, packed_values = lay.packed_tensors(keys, values)
        out = oscar_decode(query, packed_keys.buffers, packed_values.buffers, key_residual, value_residual,
                           n_packed, n_residual, k_bits=lay.k_bits, v_bits=lay.v_bits, group_size=lay.group_size,
                           scaling=self.scaling, dtype=query.dtype)
        return out.to(query.dtype)
