"""OScaR's vLLM pages on the CPU (no vLLM needed): the page layout against the method's quantizers and PackedTensor,
and the paged cache (pages + residual windows, several requests per step) against the project's own cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.ops import key_decode_layout, value_decode_layout
from oscar import build_method
from oscar.cache import QuantizedKVLayer
from oscar.quant import hadamard
from oscar_vllm import read_options
from oscar_vllm.layout import PageLayout
from oscar_vllm.paged import PagedOScaR

CONFIGS = [dict(block_size=32, num_kv_heads=2, head_dim=64, k_bits=2, v_bits=2, group_size=32),
           dict(block_size=128, num_kv_heads=4, head_dim=128, k_bits=2, v_bits=2, group_size=32),
           dict(block_size=64, num_kv_heads=1, head_dim=128, k_bits=4, v_bits=4, group_size=16)]


def _method(cfg):
    return build_method("oscar", k_bits=cfg["k_bits"], v_bits=cfg["v_bits"], group_size=cfg["group_size"],
                        residual_length=cfg["block_size"])


@pytest.mark.parametrize("cfg", CONFIGS)
def test_page_bytes_are_the_packed_bytes(cfg):
    """A page is exactly the bytes the method stores for B tokens (PackedTensor.nbytes), nothing more."""
    lay = PageLayout(**cfg, dtype=torch.bfloat16)
    x = torch.randn(1, cfg["num_kv_heads"], cfg["block_size"], cfg["head_dim"], dtype=torch.bfloat16)
    method = _method(cfg)
    stored = method.quantize_keys(x, 0).nbytes + method.quantize_values(x, 0).nbytes
    assert lay.page_bytes == stored
    assert lay.bytes_per_token * cfg["block_size"] == lay.page_bytes
    fp16_page = 2 * cfg["num_kv_heads"] * cfg["block_size"] * cfg["head_dim"] * 2
    assert lay.page_bytes < fp16_page


@pytest.mark.parametrize("cfg", CONFIGS)
def test_pages_hold_whole_groups_and_tiles(cfg):
    """Quantizing block by block into shuffled pages and gathering them back gives the whole sequence's packed
    buffers, byte for byte: the kernels' decode layout, and after the inverse layouts the method's own."""
    torch.manual_seed(0)
    b, h, d = cfg["block_size"], cfg["num_kv_heads"], cfg["head_dim"]
    n_blocks, dtype = 3, torch.float16
    lay = PageLayout(**cfg, dtype=dtype)
    k = (torch.randn(1, h, n_blocks * b, d) * torch.linspace(0.5, 4, n_blocks * b)[:, None]).to(dtype)
    v = torch.randn(1, h, n_blocks * b, d, dtype=dtype)
    paged = PagedOScaR(lay, num_slots=1, scaling=d ** -0.5)
    pages = torch.zeros(7, lay.page_bytes + 48, dtype=torch.uint8)  # rows padded past the page, as vLLM may
    block_ids = torch.tensor([5, 0, 3])
    blocks = [slice(i * b, (i + 1) * b) for i in range(n_blocks)]
    for i, s in enumerate(blocks):
        keys, values = paged.quantize(hadamard(k[:, :, s]), hadamard(v[:, :, s]))
        lay.write(pages, block_ids[i:i + 1], keys, values)
    assert pages[:, lay.page_bytes:].count_nonzero() == 0
    keys, values = lay.gather(pages, block_ids[None])

    method = build_method("oscar", k_bits=cfg["k_bits"], v_bits=cfg["v_bits"], group_size=cfg["group_size"],
                          residual_length=b)
    ref_keys, ref_values = method.quantize_keys(k, 0), method.quantize_values(hadamard(v), 0)
    for name, x in key_decode_layout(ref_keys.buffers, cfg["k_bits"]).items():
        assert torch.equal(keys[name], x), name
    for name, x in value_decode_layout(ref_values.buffers, cfg["v_bits"], cfg["group_size"]).items():
        assert torch.equal(values[name], x), name
    packed_keys, packed_values = lay.packed_tensors(keys, values)
    assert packed_keys.nbytes + packed_values.nbytes == n_blocks * lay.page_bytes
    assert torch.equal(method.dequantize(packed_keys), method.dequantize(ref_keys))
    assert torch.equal(method.dequantize(packed_values), method.dequantize(ref_values))


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=48), "multiple of 32"),
    (dict(group_size=24), "group size 24"),
    (dict(k_bits=3), "2 or 4 bits"),
    (dict(dtype=torch.float32), "float16 or bfloat16"),
])
def test_layout_refuses_pages_without_whole_groups(bad, message):
    with pytest.raises(ValueError, match=message):
        PageLayout(**{**dict(block_size=64, num_kv_heads=2, head_dim=64), **bad})


def test_views_refuse_short_or_strided_pages():
    lay = PageLayout(block_size=32, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="needs"):
        lay.views(torch.zeros(2, lay.page_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        lay.views(torch.zeros(lay.page_bytes, 2, dtype=torch.uint8).t())


def _reference_step(layer: QuantizedKVLayer, q, k, v, scaling):
    """The project's cache for one request: keys and (as if folded) rotated values in, SDPA over what it returns
    with OScaR's query rotation, the value rotation undone: [n, Hq, D]."""
    keys, values = layer.update(k.transpose(0, 1)[None], hadamard(v).transpose(0, 1)[None])
    n, total = q.shape[0], keys.shape[2]
    positions = torch.arange(total, device=q.device)
    mask = positions[None, :] <= (total - n + positions[:n])[:, None]
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(hadamard(q).transpose(0, 1)[None], keys.repeat_interleave(rep, 1),
                                         values.repeat_interleave(rep, 1), attn_mask=mask, scale=scaling)
    return hadamard(out[0].transpose(0, 1))


def two_requests(device="cpu", dtype=torch.bfloat16, h=2, hq=4, d=64):
    """Two requests through one PagedOScaR, several per step (decodes first, then prefill chunks that start and end
    inside blocks; decodes flush at 31, 63 and 95), next to the project's QuantizedKVLayer per request (block
    policy, R = B = 32). Yields (paged output, reference output, unquantized output) per request and step, then
    returns (paged, pages, {slot: (reference layer, page ids)})."""
    torch.manual_seed(0)
    b, g = 32, 32
    scaling = d ** -0.5
    lay = PageLayout(block_size=b, num_kv_heads=h, head_dim=d, group_size=g, dtype=dtype)
    paged = PagedOScaR(lay, num_slots=4, scaling=scaling, device=device)
    pages = torch.zeros(16, lay.page_bytes, dtype=torch.uint8, device=device)
    # slot: (its tokens, its pages in token order, tokens per step)
    requests = {3: (torch.randn(97, hq + 2 * h, d, dtype=dtype), [9, 2, 14, 0], [45, 18] + [1] * 34),
                1: (torch.randn(72, hq + 2 * h, d, dtype=dtype), [4, 11, 7, 5], [20] + [1] * 12 + [40])}
    requests = {s: (x.to(device), torch.tensor(ids, device=device), c) for s, (x, ids, c) in requests.items()}
    reference = {s: QuantizedKVLayer(build_method("oscar", group_size=g, residual_length=b), 0) for s in requests}
    done = {slot: 0 for slot in requests}
    for step in range(max(len(c) for _, _, c in requests.values())):
        live = [s for s in requests if step < len(requests[s][2])]
        live.sort(key=lambda s: requests[s][2][step] != 1)  # decodes first, as vLLM orders a step
        lens = [requests[s][2][step] for s in live]
        tokens = torch.cat([requests[s][0][done[s]:done[s] + n] for s, n in zip(live, lens)])
        q, k, v = tokens[:, :hq], tokens[:, hq:hq + h], tokens[:, hq + h:]
        table = torch.stack([requests[s][1] for s in live])
        out = paged.forward(pages, q, k, v, [done[s] for s in live], lens, live, table)
        at = 0
        for s, n in zip(live, lens):
            ref = _reference_step(reference[s], q[at:at + n], k[at:at + n], v[at:at + n], scaling)
            seq = requests[s][0][:done[s] + n]
            positions = done[s] + torch.arange(n, device=device)
            mask = torch.arange(done[s] + n, device=device)[None, :] <= positions[:, None]
            rep = hq // h
            exact = F.scaled_dot_product_attention(
                q[at:at + n].transpose(0, 1)[None], seq[:, hq:hq + h].transpose(0, 1)[None].repeat_interleave(rep, 1),
                seq[:, hq + h:].transpose(0, 1)[None].repeat_interleave(rep, 1), scale=scaling, attn_mask=mask)
            yield out[at:at + n], ref, exact[0].transpose(0, 1)
            at += n
            done[s] += n
    assert done == {3: 97, 1: 72}
    return paged, pages, {s: (reference[s], requests[s][1]) for s in requests}


def test_paged_cache_is_the_projects_cache():
    """Every output of the paged cache equals the project's cache bit for bit, and differs from unquantized
    attention (the quantization is really in the path)."""
    worst_exact_gap = 0.0
    for out, ref, exact in two_requests():
        assert torch.equal(out, ref)
        worst_exact_gap = max(worst_exact_gap, (out.float() - exact.float()).abs().max().item())
    assert worst_exact_gap > 0.1


def test_read_options():
    assert read_options("oscar_k2v2", {}) == read_options("oscar_k2v2", {"oscar": {"group_size": 32}})
    assert read_options("oscar_k4v4", {"oscar": {"group_size": 64}}).group_size == 64
    with pytest.raises(ValueError, match="not an OScaR dtype"):
        read_options("fp8", {})
    with pytest.raises(ValueError, match="unknown OScaR options"):
        read_options("oscar_k2v2", {"oscar": {"groups": 32}})
    with pytest.raises(ValueError, match="integer >= 16"):
        read_options("oscar_k2v2", {"oscar": {"group_size": "32"}})

