"""OScaR-KV in vLLM: an attention backend that keeps OScaR's packed K/V in vLLM's paged KV blocks.

Installed with ``pip install oscar-kv[vllm]``; vLLM finds it through the ``vllm.general_plugins`` entry point
``oscar = oscar_vllm:register`` and calls :func:`register` in every process it starts. Then

    vllm serve MODEL --kv-cache-dtype oscar_k2v2 --attention-backend OSCAR --block-size 128

stores every attention layer's cache as OScaR pages (``oscar_vllm.layout``) and decodes through the project's
kernels (``oscar_vllm.paged``; docs/serving.md has the steps and what was verified). The block size is OScaR's
residual length R; the group size G comes from ``--additional-config '{"oscar": {"group_size": 32}}'``
(default 32). This module imports vLLM only inside :func:`register`: ``import oscar_vllm`` works without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: the attention backend's name (``--attention-backend OSCAR``)
BACKEND_NAME = "OSCAR"
BACKEND_PATH = "oscar_vllm.backend.OScaRAttentionBackend"
#: ``--kv-cache-dtype`` values and their (key bits, value bits)
KV_CACHE_DTYPES = {"oscar_k2v2": (2, 2), "oscar_k4v4": (4, 4)}
#: the key of this backend's options in vLLM's ``--additional-config``
CONFIG_KEY = "oscar"
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class Options:
    k_bits: int
    v_bits: int
    group_size: int


def read_options(cache_dtype: str, additional_config: dict | None) -> Options:
    """The OScaR options of a vLLM run: bits from the KV-cache dtype, G from ``additional_config["oscar"]``."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {cache_dtype!r} is not an OScaR dtype; use one of "
                         f"{sorted(KV_CACHE_DTYPES)}")
    extra = dict((additional_config or {}).get(CONFIG_KEY) or {})
    group_size = extra.pop("group_size", DEFAULT_GROUP_SIZE)
    if extra:
        raise ValueError(f"unknown OScaR options {sorted(extra)} in --additional-config; the only one is group_size")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 16:
        raise ValueError(f"OScaR group_size must be an integer >= 16, got {group_size!r}")
    k_bits, v_bits = KV_CACHE_DTYPES[cache_dtype]
    return Options(k_bits, v_bits, group_size)


def register() -> None:
    """vLLM's general-plugin hook: the OScaR KV-cache dtypes and the ``OSCAR`` attention backend. Safe to call
    more than once (vLLM loads plugins once per process, tests may call it again)."""
    import torch
    from vllm.config.cache import is_known_kv_cache_dtype, register_kv_cache_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import KVQuantMode

    from oscar_vllm import core

    missing = core.missing()
    if missing:
        raise RuntimeError("oscar-kv's vLLM plugin needs, from vLLM's core: " + "; ".join(missing)
                           + f" (verified with vLLM {core.VERIFIED_VLLM})")
    for name in KV_CACHE_DTYPES:
        if not is_known_kv_cache_dtype(name):
            register_kv_cache_dtype(name)(_dtype_handler(name, torch.uint8, KVQuantMode.CUSTOM))
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    for defect in core.defects():
        logger.warning("oscar-kv: %s", defect)


def _dtype_handler(name: str, storage, mode) -> type:
    """vLLM's KVCacheDTypeHandler for one OScaR dtype: pages of raw bytes (``storage``), kernels chosen by the
    backend (``mode`` = KVQuantMode.CUSTOM)."""
    return type(f"OScaRKVCacheDType_{name}", (), dict(name=name, torch_dtype=lambda self: storage,
                                                      quant_mode=lambda self: mode))
