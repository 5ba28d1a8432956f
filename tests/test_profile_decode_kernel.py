"""scripts/profile_decode_kernel.py (decode_attention at one shape for Nsight Compute): its arguments, and a clear
refusal without a GPU before any cache is built (the profiled run itself: results/efficiency/kernel_profile.log,
on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from scripts import profile_decode_kernel


def test_refuses_without_a_gpu_and_unknown_methods(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []
    monkeypatch.setattr(profile_decode_kernel, "method_cache", lambda *a, **k: built.append(a))
    with pytest.raises(SystemExit) as refused:
        profile_decode_kernel.main(["--batch", "1", "--context", "4096", "--methods", "oscar", "kivi"])
    assert refused.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err and not built
    with pytest.raises(SystemExit):
        profile_decode_kernel.main(["--methods", "ott"])  # not one of the kernel question's methods
    assert "invalid choice: 'ott'" in capsys.readouterr().err
    for bad in ("4", "4:2", "0:1", "x:0"):  # RotateKV's knobs: checked before the GPU is asked for
        with pytest.raises(SystemExit):
            profile_decode_kernel.main(["--methods", "rotatekv_logits", "--rotatekv-knobs", "default", bad])
        assert f"{bad!r}: 'default' or MIN_BLOCKS:ROPE_PER_TILE" in capsys.readouterr().err
    assert profile_decode_kernel.rotatekv_knobs("4:0") == (4, 0)
    assert profile_decode_kernel.rotatekv_knobs("default") == (None, None)
