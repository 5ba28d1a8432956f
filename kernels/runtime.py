"""Compiling and launching the CuPy RawKernels of kernels/*.cu, and the input checks every launcher shares.

Each ``.cu`` file is compiled once per set of #defines (head_dim, bits, group size, dtype, method, ...) with
``cupy.RawModule`` and memoized per device; batch and sequence length are runtime arguments. Kernels run on torch's
current stream and read/write torch tensors in place (pointers from ``data_ptr``: no copies). ``cupy`` is imported on
first use, so CPU-only installs import this module fine.

The launchers (kernels.quantizers, kernels.attention, kernels.layers) call :func:`launch`, :func:`device_index`,
:func:`multiprocessors`, :func:`check_input` (which :func:`accepts` asks) and :func:`check_cuda` through this module
(``runtime.launch(...)``), so that the tests' CPU emulator can stand in for them in one place
(tests/test_method_kernels_emulated.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from oscar.transfer import device_ints

KERNEL_DIR = Path(__file__).parent
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BITS = (2, 4)


@functools.cache
def cupy():
    """The ``cupy`` module (imported on first use); ImportError naming the package to install."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("backend=cupy needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)") from e
    return cupy


def cupy_available() -> bool:
    """Whether the kernels can run here: CuPy imports and a CUDA GPU is present."""
    try:
        cupy()
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _function(device_index: int, source: str, name: str, defines: tuple[tuple[str, int], ...]):
    """The compiled kernel ``name`` of kernels/<source> for these #defines on this device (memoized)."""
    options = ("--std=c++17", f"-I{KERNEL_DIR}") + tuple(f"-D{k}={v}" for k, v in defines)
    if os.environ.get("OSCAR_KERNEL_LINEINFO"):  # source lines for profilers (ncu's SourceCounters); same code
        options += ("--generate-line-info",)
    with cupy().cuda.Device(device_index):
        module = cupy().RawModule(code=(KERNEL_DIR / source).read_text(), options=options)
        return module.get_function(name)


@functools.cache
def _stream(device_index: int, handle: int):
    return cupy().cuda.ExternalStream(handle, device_index)


_smem_opt_in: set = set()


def device_index(device) -> int:
    """The CUDA index of ``device`` (the current device for a bare "cuda")."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def multiprocessors(device_index: int) -> int:
    """Streaming multiprocessors of that GPU."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(source: str, name: str, defines: dict, grid, block, args, device: torch.device, smem: int = 0):
    """Launch on ``device`` (its tensors' GPU) and torch's current stream there; the current device is kept."""
    index = device_index(device)
    key = (index, source, name, tuple(sorted(defines.items())))
    fn = _function(*key)
    stream = _stream(index, torch._C._cuda_getCurrentRawStream(index))  # torch's current stream there, no wrapper
    packed = tuple(np.uint64(a.data_ptr()) if isinstance(a, Tensor) else a for a in args)
    # a layer on another GPU than the current one (a split model): launch in that GPU's context, then back
    with contextlib.nullcontext() if torch.cuda.current_device() == index else cupy().cuda.Device(index):
        if smem > 48 * 1024 and (key, smem) not in _smem_opt_in:
            fn.max_dynamic_shared_size_bytes = max(smem, fn.max_dynamic_shared_size_bytes)
            _smem_opt_in.add((key, smem))
        fn(grid, block, packed, shared_mem=smem, stream=stream)


# ----------------------------------------------------------------------------- arguments


def check_cuda(x: Tensor, name: str) -> None:
    """Raise ValueError unless ``x`` is a CUDA tensor."""
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")


def check_input(x: Tensor, name: str, dims: int | None = None) -> None:
    """Raise ValueError unless ``x`` is a bf16/fp16 CUDA tensor (of ``dims`` dims) with a supported head_dim."""
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(x.shape)}")
    if x.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {x.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}")


def accepts(x: Tensor) -> bool:
    """Whether :func:`check_input` passes ``x``: a bf16/fp16 CUDA tensor with a supported head_dim."""
    try:
        check_input(x, "x")
    except ValueError:
        return False
    return True


def dtype_define(dtype: torch.dtype) -> int:
    """The IS_BF16 define of a model dtype."""
    return int(dtype == torch.bfloat16)


def inv(x: float) -> np.float32:
    """1/x as torch computes ``tensor / python_scalar`` on CUDA: fp32 reciprocal of the fp32 divisor."""
    return np.float32(1.0) / np.float32(x)


def float_zero_point(zero_point: str) -> bool:
    """Whether a ``zero_point`` name ("int" or "float") is the float convention; ValueError otherwise."""
    if zero_point not in ("int", "float"):
        raise ValueError(f"zero_point must be 'int' or 'float', got {zero_point!r}")
    return zero_point == "float"


def targets(batch: int, rows, offsets, device):
    """Output rows and token offsets of the input sequences as int32 device arrays; null pointers (no copy to
    the device) for the default, sequence i into row i at token 0."""
    if rows is None and offsets is None:
        return np.uint64(0), np.uint64(0)
    rows = list(range(batch)) if rows is None else list(rows)
    offsets = [0] * batch if offsets is None else list(offsets)
    if len(rows) != batch or len(offsets) != batch:
        raise ValueError("rows and offsets need one entry per input sequence")
    return device_ints(rows, device), device_ints(offsets, device)
