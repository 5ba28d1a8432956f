"""vLLM's side of the OSCAR attention backend: the backend class, its metadata builder and its implementation.

Imported by vLLM only (``--attention-backend OSCAR`` resolves ``oscar_vllm.backend.OScaRAttentionBackend``); it
imports vLLM at module level. The storage and the arithmetic live in :mod:`oscar_vllm.paged` and
:mod:`oscar_vllm.layout`; this module translates vLLM's metadata into their arguments and refuses what they do not
cover, each with one line at startup:

- the block size is OScaR's residual length R, given with ``--block-size`` (vLLM settles its default only after
  the model is built) and holding whole key groups and value tiles (a multiple of lcm(G, 16)); the residual
  windows ([max_num_seqs, H, R, D] keys + values per layer, model dtype) are allocated when the model is built,
  so vLLM's memory profile counts them before it sizes the pages;
- decoder self-attention only; no sliding window, ALiBi, soft cap, attention sinks, KV sharing across layers,
  speculative decoding (a rejected draft token may already sit in a flushed block) or KV connectors (the residual
  window is not in the pages they move); prefix caching only at whole blocks (``prefix_match_unit`` unset or = B);
- no CUDA graphs for attention (AttentionCGSupport.NEVER: the step's lengths are read on the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from oscar_vllm import BACKEND_NAME, KV_CACHE_DTYPES, read_options
from oscar_vllm.layout import VALUE_TILE, PageLayout
from oscar_vllm.paged import PagedOScaR

#: head dims and query heads per KV head that kernels/decode_attention.cu is compiled for
HEAD_DIMS = (64, 128, 256)
MAX_QUERY_HEADS_PER_KV_HEAD = 8


def _options(vllm_config):
    return read_options(vllm_config.cache_config.cache_dtype, vllm_config.additional_config)


class OScaRAttentionBackend(AttentionBackend):
    """OScaR pages in vLLM's KV cache (``--kv-cache-dtype oscar_k2v2|oscar_k4v4``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the store needs the step's metadata (residual windows)
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[OScaRAttentionImpl]:
        return OScaRAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OScaRMetadataBuilder]:
        return OScaRMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        """Blocks of whole key groups and value tiles (a multiple, never split by vLLM into kernel blocks)."""
        config = get_current_vllm_config()
        group = _options(config).group_size if config.cache_config.cache_dtype in KV_CACHE_DTYPES else 32
        return [MultipleOf(math.lcm(group, VALUE_TILE))]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)  # one head slot: both keep a page's bytes together

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_DIMS)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8  # the decode kernel's bf16/fp16 mma tiles

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One head slot of ``bytes_per_token`` bytes per token: the page of :class:`PageLayout` (its bytes are
        linear in the block size, so vLLM's one-token sizing and its real pages agree)."""
        config = get_current_vllm_config()
        if spec.state_content_bytes is not None or config.cache_config.cache_dtype not in KV_CACHE_DTYPES:
            return spec
        opts = _options(config)
        # scale/zero are 2 bytes in float16 and bfloat16 alike: the page size does not depend on which
        layout = PageLayout(math.lcm(opts.group_size, VALUE_TILE), spec.num_kv_heads, spec.head_size, opts.k_bits,
                            opts.v_bits, opts.group_size, torch.float16)
        return replace(spec, num_head_slots=1, state_content_bytes=layout.bytes_per_token)


@dataclass
class OScaRMetadata(AttentionMetadata):
    """One step's requests, decodes first: host lists (the bookkeeping is done on the host) + the block table."""

    num_actual_tokens: int  # tokens of the step's requests (the query may be padded past them)
    starts: list[int]  # tokens of each request already in the cache
    query_lens: list[int]  # new tokens of each request in this step
    slots: list[int]  # each request's residual window (vLLM's request index)
    block_table: torch.Tensor  # [requests, max_blocks] page ids (device)


class OScaRMetadataBuilder(AttentionMetadataBuilder[OScaRMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OScaRMetadata:
        cam = common_attn_metadata
        if cam.req_idx is None:
            raise RuntimeError("the OSCAR backend needs vLLM's model runner V2 (CommonAttentionMetadata.req_idx "
                               "names each request's residual window); unset VLLM_USE_V2_MODEL_RUNNER=0")
        n = cam.num_reqs
        bounds = cam.query_start_loc_cpu[:n + 1].tolist()
        query_lens = [b - a for a, b in zip(bounds, bounds[1:])]
        seq_lens = (cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None
                    else cam.seq_lens.cpu())[:n].tolist()  # exact without speculative decoding (refused)
        rows = [i for i, q in enumerate(query_lens) if q > 0]  # padding rows carry no token
        table = cam.block_table_tensor[:n] if len(rows) == n else cam.block_table_tensor[rows]
        return OScaRMetadata(num_actual_tokens=bounds[-1], starts=[seq_lens[i] - query_lens[i] for i in rows],
                             query_lens=[query_lens[i] for i in rows], slots=[int(cam.req_idx[i]) for i in rows],
                             block_table=table)


class OScaRAttentionImpl(AttentionImpl[OScaRMetadata]):
    """Attention of one layer over its OScaR pages and residual windows (:class:`oscar_vllm.paged.PagedOScaR`)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **kwargs) -> None:
        config = get_current_vllm_config()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        refused = dict(alibi=alibi_slopes is not None, sliding_window=sliding_window is not None,
                       logits_soft_cap=bool(logits_soft_cap), attention_sinks=kwargs.get("sinks") is not None,
                       kv_sharing=kv_sharing_target_layer_name is not None,
                       speculative_decoding=config.speculative_config is not None)
        refused[f"attention type {attn_type}"] = attn_type != AttentionType.DECODER
        refused[f"{num_heads // self.num_kv_heads} query heads per KV head (kernel: 1..8)"] = (
            num_heads % self.num_kv_heads or num_heads // self.num_kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD)
        cache = config.cache_config
        # vLLM settles a default block size only after the model is built: the windows need it now
        refused["no --block-size (OScaR's residual length R, e.g. 128)"] = not cache.user_specified_block_size
        unit = cache.prefix_match_unit
        refused[f"prefix_match_unit {unit} other than the block size {cache.block_size}"] = (
            cache.enable_prefix_caching and unit is not None and unit != cache.block_size)
        if any(refused.values()):
            raise NotImplementedError("the OSCAR backend does not support: "
                                      + ", ".join(k for k, v in refused.items() if v))
        opts = read_options(kv_cache_dtype, config.additional_config)
        # the model dtype, as vLLM's Attention layer reads it while the model is built
        layout = PageLayout(cache.block_size, self.num_kv_heads, head_size, opts.k_bits, opts.v_bits,
                            opts.group_size, torch.get_default_dtype())
        # allocated while vLLM builds the model (its default device), so the memory profile counts it
        self.paged = PagedOScaR(layout, config.scheduler_config.max_num_seqs, scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: OScaRMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the OSCAR backend does not fuse output quantization")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        out = self.paged.forward(self.pages(kv_cache), query[:n].view(n, self.num_heads, self.head_size),
                                 key[:n].view(n, self.num_kv_heads, self.head_size),
                                 value[:n].view(n, self.num_kv_heads, self.head_size), attn_metadata.starts,
                                 attn_metadata.query_lens, attn_metadata.slots, attn_metadata.block_table)
        output[:n] = out.reshape(output[:n].shape)
        output[n:] = 0  # padding tokens
        return output

    def pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's layer view [num_blocks, 1 head slot, B, bytes per token] -> [num_blocks, page bytes] (a view)."""
        block = self.paged.layout.block_size
        if kv_cache.dim() != 4 or kv_cache.shape[1] != 1 or kv_cache.shape[2] != block:
            raise ValueError(f"expected the KV cache as [num_blocks, 1, {block}, bytes], got {tuple(kv_cache.shape)}")
        page = kv_cache[:, 0]
        if page.stride(2) != 1 or page.stride(1) != page.shape[2]:
            raise ValueError(f"a page's bytes are not contiguous (strides {kv_cache.stride()}): use the LBHNC layout")
        return page.as_strided((page.shape[0], block * page.shape[2]), (page.stride(0), 1))
