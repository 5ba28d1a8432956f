"""What a run IS: its identity, computed from the resolved configuration and the files it reads.

:func:`run_identity` is the one place that decides it. It holds the whole composed configuration (every model,
method, task and backend option, ``seed``, ``prefill_chunk``, and any key added later) except the keys of
:data:`NOT_IN_IDENTITY`, each listed with why it changes no number; in their place it holds what they resolve to:
the device TYPE (cpu / cuda / mps, not the GPU index), the dtype the run computes in on it (``dtype: null`` and
``auto`` are bf16 on CUDA and fp32 elsewhere: the resolved name is hashed, never ``null``) and the decode step's
fused layers (:func:`fused_layers_on`: ``auto`` is off off a GPU). Beside the options it
holds the content digests of every file the run reads (:func:`run_files`): the task's data files, the method's
calibration file and, for a GGUF model, the converted copy's manifest (the SHA-256 recorded for every file of it:
weights, config, tokenizer), likewise for the model whose tokenizer a model borrows.

:func:`identity_digest` hashes it: a run's id is its first 10 hex digits (the run folder's name), the config digest
of its rows and metrics.json its first 12. The commit of the code (oscar.provenance.code_version, with ``+dirty``) is
recorded beside the numbers, not in the identity: a code change that changes numbers shows as a row that disagrees
with an older one (``make reproduce``), never as a silently reused run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from oscar.manifest import MANIFEST
from oscar.models import ModelSpec, converted_location, load_spec, resolve_dtype
from oscar.placement import accelerate_device, torch_device

#: configuration keys (dotted paths; a key covers every key under it) left out of the identity, with the reason
NOT_IN_IDENTITY: dict[str, str] = {
    # where results go and what is shown: no number depends on them
    "runs_dir": "where run folders are written",
    "results_file": "where tidy rows are appended",
    "logger": "how the run folder is mirrored to W&B",
    "show_tables": "what is logged after a run",
    "rerun": "whether a finished run is computed again, not what it computes",
    # resolved: the identity holds what they resolve to
    "data_root": "where data is looked for first; the identity holds the content digest of the files found",
    "device": "the identity holds its type (cpu/cuda/mps); which GPU of a type runs it changes no number",
    "dtype": "the identity holds the dtype it resolves to on the device type",
    "model.dtype": "the identity holds the dtype it resolves to on the device type",
    # how the same computation is laid out
    "model.device_map": "which GPU holds which layer: every layer computes the same numbers on any GPU of the type",
    "model.max_memory": "a budget for planning model.device_map",
    "decode": "graph replays the kernels of the eager decode step, the same tokens (tests/test_engine_gpu.py); "
              "auto is graph on one GPU, eager elsewhere",
    "fused_layers": "the identity holds what it resolves to (resolved.fused_layers): the fused norms and SiLU round "
                    "in another order than transformers' modules, so on, merged and off are three identities",
}


def _without(node, path: str = ""):
    """``node`` (a config dict) without the keys of NOT_IN_IDENTITY."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        dotted = f"{path}{key}"
        if dotted not in NOT_IN_IDENTITY:
            out[key] = _without(value, dotted + ".")
    return out


def device_type(spec: ModelSpec, device: str) -> str:
    """The type of the device the run computes on: ``device``'s (``cuda:1`` -> cuda), or for a model spread by
    ``model.device_map`` its first device's (as :func:`oscar.models.plan_placement` resolves the dtype: an
    ``auto``/``balanced``/``sequential`` map starts on the default device)."""
    if spec.device_map is not None:
        first = next(iter(spec.device_map.values())) if isinstance(spec.device_map, dict) else device
        return torch_device(accelerate_device(first)).type
    return torch_device(device).type


def fused_layers_on(option: str, kind: str) -> str:
    """What ``fused_layers`` resolves to on a device of type ``kind``, as far as the configuration decides it: off
    anywhere but CUDA; ``auto`` on CUDA is merged where CuPy is installed (the cupy backend's kernels; a model family they
    do not fuse decodes unfused either way, and the model is in the identity); ``on`` / ``merged`` / ``off`` as set
    (oscar.engine.resolve_fused_layers refuses what cannot run)."""
    if kind != "cuda":
        return "off"
    if option == "auto":
        return "merged" if importlib.util.find_spec("cupy") is not None else "off"
    return option


def run_identity(config: dict, device: str, files: dict[str, str | None]) -> dict:
    """The identity of the run of ``config`` (the composed configuration, interpolations resolved) on ``device``
    (a device type or name: only the type counts) reading ``files`` (:func:`run_files`): the config without
    NOT_IN_IDENTITY, ``resolved`` {device_type, dtype, fused_layers} and the files' digests (None ones left out)."""
    dtype = config.get("dtype") or (config.get("model") or {}).get("dtype") or "auto"
    kind = torch_device(device).type
    identity = _without(config)
    identity["resolved"] = dict(device_type=kind, dtype=str(resolve_dtype(dtype, kind)).removeprefix("torch."),
                                fused_layers=fused_layers_on(config.get("fused_layers", "auto"), kind))
    identity["files"] = {name: digest for name, digest in files.items() if digest is not None}
    return identity


def identity_digest(identity: dict) -> str:
    """SHA-1 (40 hex digits) of the identity's JSON; the run id is its first 10, the config digest its first 12."""
    return hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------- the files a run reads


def files_digest(files: list[Path]) -> str | None:
    """SHA-1 (12 hex digits) of the files' names and contents, in the given order (a missing file counts as
    missing: the checks refuse it before the run); None for no files."""
    if not files:
        return None
    digest = hashlib.sha1()
    for path in map(Path, files):
        if not path.is_file():
            digest.update(f"{path.name}\0missing\0".encode())
            continue
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def weights_digest(spec: ModelSpec, convert: bool = False) -> str | None:
    """What identifies a GGUF model's weights (None for the others: a ``config`` model's are its seeded config, a hub
    model's its ``hf_id``, ``revision`` and ``path``, all options): the SHA-256s its converted copy's manifest
    recorded (every file: weights, config, tokenizer), digested. A model not converted yet has none; its stand-in
    (``unconverted:`` + the package, version and file) is never a finished run's: ``convert`` converts it first (the
    preflight does, before the weights load, so every run folder is named by the manifest)."""
    if spec.source != "gguf":
        return None
    if convert:
        from oscar.models import converted_gguf_dir

        converted_gguf_dir(spec)  # checked against its manifest, converted once when absent
    try:
        entries = json.loads((converted_location(spec) / MANIFEST).read_text())["files"]
        recorded = sorted((name, entry["sha256"]) for name, entry in entries.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not converted (or the check redoes it)
        return f"unconverted:{_gguf_source(spec)}"
    return hashlib.sha1(json.dumps(recorded).encode()).hexdigest()[:12]


def _gguf_source(spec: ModelSpec) -> str:
    try:
        version = importlib.metadata.version(spec.gguf_package)
    except importlib.metadata.PackageNotFoundError:
        version = "not-installed"
    return f"{spec.gguf_package}=={version}/{spec.gguf_file}"


def run_files(task, method, spec: ModelSpec, convert: bool = False) -> dict[str, str | None]:
    """The digests of what a run reads: ``data`` (the task's ``data_files()``), ``calibration`` (the method's
    ``data_files()``), ``weights`` (:func:`weights_digest`) and, for a model that borrows another's tokenizer,
    ``tokenizer`` (that model's weights digest: its converted copy holds the tokenizer)."""
    files = dict(data=files_digest(task.data_files()), calibration=files_digest(method.data_files()),
                 weights=weights_digest(spec, convert))
    if spec.tokenizer:
        files["tokenizer"] = weights_digest(load_spec(spec.tokenizer), convert)
    return files


def unconverted(files: dict[str, str | None]) -> bool:
    """Whether ``files`` holds a stand-in for a GGUF model not converted yet."""
    return any(str(digest).startswith("unconverted:") for digest in files.values())
