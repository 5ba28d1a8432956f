"""The vLLM plugin against a real vLLM (CI-optional: skipped when vLLM is not installed; docs/serving.md says how to
install it beside the project). On a machine without a GPU vLLM is pointed at its CPU platform, which only decides
how vLLM parses its configs here: the backend's step runs through the kernels' torch references on the CPU."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM infers no device type from a GPU-less machine
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (docs/serving.md installs it)")

from vllm.config import CacheConfig, SchedulerConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, get_kv_quant_mode  # noqa: E402

import oscar_vllm  # noqa: E402
from oscar import build_method  # noqa: E402
from oscar.cache import QuantizedKVLayer  # noqa: E402
from oscar_vllm import core  # noqa: E402
from oscar_vllm.layout import PageLayout  # noqa: E402
from test_vllm_layout import _reference_step  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    load_general_plugins()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum["OSCAR"].get_class()


def _config(block_size=32, cache_dtype="oscar_k2v2", max_num_seqs=4, **additional):
    return VllmConfig(cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024,
                                                       max_num_batched_tokens=1024, is_encoder_decoder=False),
                      additional_config=additional)


def test_the_entry_point_is_installed():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("oscar") == "oscar_vllm:register"


def test_vllms_loader_registers_the_dtypes_and_the_backend(backend):
    from vllm.config.cache import KV_CACHE_DTYPES
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oscar_vllm.backend import OScaRAttentionBackend

    assert backend is OScaRAttentionBackend and backend.get_name() == "OSCAR"
    for name in oscar_vllm.KV_CACHE_DTYPES:
        assert name in KV_CACHE_DTYPES and STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8
        assert get_kv_quant_mode(name) == KVQuantMode.CUSTOM
        assert CacheConfig(cache_dtype=name).cache_dtype == name
    with pytest.raises(ValueError, match="Invalid kv_cache_dtype"):
        CacheConfig(cache_dtype="oscar_k3v3")
    members, dtypes = len(AttentionBackendEnum.__members__), len(KV_CACHE_DTYPES)
    oscar_vllm.register()  # a second load (vLLM loads plugins once per process, but more processes may import)
    assert (len(AttentionBackendEnum.__members__), len(KV_CACHE_DTYPES)) == (members, dtypes)


def test_vllms_cli_takes_the_dtype_and_the_backend(backend):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "oscar_k2v2", "--attention-backend", "OSCAR",
                              "--block-size", "128", "--additional-config", '{"oscar": {"group_size": 32}}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.kv_cache_dtype, engine_args.attention_backend, engine_args.block_size) == \
        ("oscar_k2v2", "OSCAR", 128)
    assert oscar_vllm.read_options(engine_args.kv_cache_dtype, engine_args.additional_config).group_size == 32


def test_core_needs_are_present_and_the_patch_applies(tmp_path, monkeypatch, backend):
    from vllm.v1.kv_cache_interface import __file__ as interface_file

    assert core.missing() == []
    aliased = KVQuantMode(KVQuantMode.CUSTOM.value).name != "CUSTOM"
    assert bool(core.defects()) == aliased
    (tmp_path / "vllm" / "v1").mkdir(parents=True)
    shutil.copy(interface_file, tmp_path / "vllm" / "v1" / "kv_cache_interface.py")
    if not aliased:
        pytest.skip("this vLLM has no CUSTOM alias: the patch is already in")
    core.apply_patch(tmp_path)
    spec = importlib.util.spec_from_file_location("patched_interface", tmp_path / "vllm/v1/kv_cache_interface.py")
    patched = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, patched)  # its dataclasses look their module up there
    spec.loader.exec_module(patched)
    assert patched.KVQuantMode.CUSTOM.name == "CUSTOM" and patched.KVQuantMode.OCTAVE_K3V4.name == "OCTAVE_K3V4"
    assert not patched.KVQuantMode.CUSTOM.is_octave
    with pytest.raises(RuntimeError, match="does not apply"):
        core.apply_patch(tmp_path)  # a second time: already applied


def test_backend_selection_rules(backend):
    good = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="oscar_k2v2", block_size=128, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type="decoder")
    with set_current_vllm_config(_config(block_size=128)):
        assert backend.validate_configuration(**good) == []
        for change, reason in [(dict(block_size=48), "block_size"), (dict(head_size=96), "head_size"),
                               (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"), (dict(dtype=torch.float32), "dtype"),
                               (dict(has_sliding_window=True), "sliding window"),
                               (dict(device_capability=DeviceCapability(7, 5)), "compute capability"),
                               (dict(use_kv_connector=True), "KV connector")]:
            reasons = backend.validate_configuration(**{**good, **change})
            assert any(reason in r for r in reasons), (change, reasons)


@pytest.mark.parametrize("cache_dtype, heads, head_dim, group", [("oscar_k2v2", 8, 128, 32), ("oscar_k4v4", 2, 64, 16)])
def test_vllms_page_is_the_layouts_page(backend, cache_dtype, heads, head_dim, group):
    bits = oscar_vllm.KV_CACHE_DTYPES[cache_dtype]
    with set_current_vllm_config(_config(block_size=128, cache_dtype=cache_dtype, oscar=dict(group_size=group))):
        for block in (1, 128):  # vLLM sizes pages from one token, then allocates blocks
            spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=torch.uint8,
                                     kv_quant_mode=get_kv_quant_mode(cache_dtype))
            page = backend.customize_spec(spec).page_size_bytes
            layout = PageLayout(128, heads, head_dim, *bits, group_size=group)
            assert page == layout.bytes_per_token * block
        assert page == layout.page_bytes


def _common(starts, lens, req_idx, table):
    seq_lens = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
    bounds = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=bounds, query_start_loc_cpu=bounds, seq_lens=seq_lens, num_reqs=len(lens),
        num_actual_tokens=sum(lens), max_query_len=max(lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.zeros(sum(lens), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens, req_idx=torch.tensor(req_idx).numpy())


def test_the_backend_steps_like_the_projects_cache(backend):
    """vLLM's builder and implementation of the OSCAR backend, on a KV-cache tensor shaped as vLLM allocates it,
    over prefill, mixed and decode steps of two requests: every output equals the project's own cache."""
    torch.manual_seed(0)
    b, hq, h, d = 32, 4, 2, 64
    config = _config(block_size=b)
    with set_current_vllm_config(config):
        spec = backend.customize_spec(FullAttentionSpec(block_size=b, num_kv_heads=h, head_size=d, dtype=torch.uint8,
                                                        kv_quant_mode=KVQuantMode.CUSTOM))
        builder = backend.get_builder_cls()(spec, ["layer.0"], config, torch.device("cpu"))
        torch.set_default_dtype(torch.bfloat16)  # what vLLM sets while it builds the model
        try:
            impl = backend.get_impl_cls()(hq, d, d ** -0.5, h, kv_cache_dtype="oscar_k2v2")
        finally:
            torch.set_default_dtype(torch.float32)
    kv_cache = torch.zeros(12, 1, b, spec.state_content_bytes, dtype=torch.uint8)
    tables = {2: torch.tensor([3, 8, 1, 10]), 0: torch.tensor([5, 0, 7, 2])}
    tokens = {r: torch.randn(100, hq + 2 * h, d, dtype=torch.bfloat16) for r in tables}
    reference = {r: QuantizedKVLayer(build_method("oscar", group_size=32, residual_length=b), 0) for r in tables}
    done = {r: 0 for r in tables}
    steps = [[(2, 40)], [(2, 1), (0, 70)]] + [[(2, 1), (0, 1)]] * 25  # decodes first, as vLLM orders a step
    for step in steps:
        reqs, lens = [r for r, _ in step], [n for _, n in step]
        x = torch.cat([tokens[r][done[r]:done[r] + n] for r, n in step])
        q, k, v = (x[:, :hq].reshape(len(x), -1), x[:, hq:hq + h].reshape(len(x), -1),
                   x[:, hq + h:].reshape(len(x), -1))
        md = builder.build(0, _common([done[r] for r in reqs], lens, reqs, torch.stack([tables[r] for r in reqs])))
        out = impl.forward(None, q, k, v, kv_cache, md, torch.empty(len(x), hq * d, dtype=torch.bfloat16))
        at = 0
        for r, n in step:
            ref = _reference_step(reference[r], x[at:at + n, :hq], x[at:at + n, hq:hq + h], x[at:at + n, hq + h:],
                                  d ** -0.5)
            assert torch.equal(out[at:at + n].view(n, hq, d), ref), (step, r)
            at += n
            done[r] += n
    assert done == {2: 66, 0: 95}
    assert impl.forward(None, q, k, v, kv_cache, None, torch.ones(len(x), hq * d)).count_nonzero() == 0
    # a padded step: a request row without tokens (its index out of range) and two padding tokens
    padded = [torch.cat([t, torch.randn(2, t.shape[1], dtype=t.dtype)]) for t in (q, k, v)]
    common = _common([done[2] - 1, done[0] - 1, 7], [1, 1, 0], [2, 0, 99],
                     torch.stack([tables[2], tables[0], torch.zeros(4, dtype=torch.long)]))
    common.num_actual_tokens = len(padded[0])
    before = kv_cache.clone()
    out = impl.forward(None, *padded, kv_cache, builder.build(0, common), torch.ones(len(padded[0]), hq * d))
    assert out[-2:].count_nonzero() == 0 and torch.isfinite(out[:2]).all()
    assert torch.equal(kv_cache, before)  # the two real tokens rewrite their window slots only (no block fills)


def test_the_backend_refuses_what_it_does_not_cover(backend):
    with set_current_vllm_config(_config()):
        impl_cls = backend.get_impl_cls()
        with pytest.raises(NotImplementedError, match="sliding_window"):
            impl_cls(4, 64, 0.125, 2, sliding_window=128, kv_cache_dtype="oscar_k2v2")
        with pytest.raises(NotImplementedError, match="16 query heads per KV head"):
            impl_cls(32, 64, 0.125, 2, kv_cache_dtype="oscar_k2v2")
    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(cache_dtype="oscar_k2v2"))):
        with pytest.raises(NotImplementedError, match="no --block-size"):
            impl_cls(4, 64, 0.125, 2, kv_cache_dtype="oscar_k2v2")
    with set_current_vllm_config(_config()):
        spec = backend.customize_spec(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                                        dtype=torch.uint8, kv_quant_mode=KVQuantMode.CUSTOM))
        builder = backend.get_builder_cls()(spec, ["layer.0"], _config(), torch.device("cpu"))
    common = _common([0], [4], [0], torch.zeros(1, 2, dtype=torch.int32))
    common.req_idx = None
    with pytest.raises(RuntimeError, match="model runner V2"):
        builder.build(0, common)


def test_the_core_report_and_a_vllm_free_import(capsys):
    assert core.main([]) == 0
    report = capsys.readouterr().out
    assert f"vLLM {vllm.__version__}" in report and "needs from the core: all present" in report
    assert ("defect: " in report) == bool(core.defects())
    code = ("import sys, oscar_vllm, oscar_vllm.layout, oscar_vllm.paged, oscar_vllm.core; "
            "sys.exit('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
