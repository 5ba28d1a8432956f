"""What this integration needs from vLLM's core, in one place: checked at registration, patched where it is wrong.

An INT2 KV cache touches three things a plugin cannot add by itself. In the vLLM checked here
(:data:`VERIFIED_VLLM`) each has an extension point, so no core change is required to run:

1. the KV-cache dtype list (``CacheDType`` in vllm/config/cache.py) is a closed ``Literal``, but
   ``vllm.config.cache.register_kv_cache_dtype`` appends to its mutable mirror ``KV_CACHE_DTYPES`` and maps the
   name to a storage dtype (raw bytes, ``torch.uint8``) and a ``KVQuantMode``;
2. the page size derives from the dtype (``AttentionSpec.page_size_bytes`` = heads x tokens x bytes per state),
   but a backend rewrites its layer's spec (``AttentionBackend.customize_spec``: ``num_head_slots`` = 1 and
   ``state_content_bytes`` = the bytes of one token of an OScaR page);
3. the residual window of a request needs a stable per-request index: ``CommonAttentionMetadata.req_idx``
   (filled by the model runner V2, vLLM's default; the V1 runner leaves it None and the backend refuses).

:func:`missing` names any of these that the installed vLLM lacks (an older or newer vLLM whose API moved);
the plugin then refuses to register. One defect of the core is patched by ``vllm_core.patch`` (next to this file):
``KVQuantMode.CUSTOM`` has the value 12, which is ``OCTAVE_K3V4``'s, so in this IntEnum CUSTOM *is* OCTAVE_K3V4
(``is_octave`` is True for every custom dtype, and logs name it OCTAVE_K3V4). Nothing on the CUDA path of this
backend branches on it, so the plugin runs unpatched; :func:`defects` reports it, and

    python -m oscar_vllm.core            # what the installed vLLM has and lacks
    python -m oscar_vllm.core --apply    # apply vllm_core.patch to the installed vLLM (after a dry run)

fixes it in place (``patch -p1`` in the folder that holds the ``vllm`` package).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

VERIFIED_VLLM = "0.33.0"
PATCH = Path(__file__).with_name("vllm_core.patch")

#: (what the plugin uses, module, attribute, dataclass field of that attribute or None)
REQUIRED = (
    ("register_kv_cache_dtype (custom --kv-cache-dtype values)", "vllm.config.cache", "register_kv_cache_dtype", None),
    ("KVQuantMode.CUSTOM", "vllm.v1.kv_cache_interface", "KVQuantMode", None),
    ("AttentionSpec.num_head_slots", "vllm.v1.kv_cache_interface", "AttentionSpec", "num_head_slots"),
    ("AttentionSpec.state_content_bytes", "vllm.v1.kv_cache_interface", "AttentionSpec", "state_content_bytes"),
    ("AttentionBackend.customize_spec", "vllm.v1.attention.backend", "AttentionBackend", None),
    ("CommonAttentionMetadata.req_idx", "vllm.v1.attention.backend", "CommonAttentionMetadata", "req_idx"),
    ("register_backend with a new backend name", "vllm.v1.attention.backends.registry", "register_backend", None),
)


def missing() -> list[str]:
    """What the installed vLLM lacks of :data:`REQUIRED` (empty when everything is there)."""
    out = []
    for what, module_name, attribute, field in REQUIRED:
        try:
            obj = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            out.append(f"{what} ({module_name}.{attribute})")
            continue
        if field is not None and field not in {f.name for f in dataclasses.fields(obj)}:
            out.append(f"{what} ({module_name}.{attribute}.{field})")
        elif attribute == "KVQuantMode" and "CUSTOM" not in obj.__members__:
            out.append(what)
        elif attribute == "AttentionBackend" and not hasattr(obj, "customize_spec"):
            out.append(what)
    return out


def defects() -> list[str]:
    """Defects of the installed vLLM's core that ``vllm_core.patch`` fixes (empty once it is applied)."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    # __members__ lists aliases too (iterating the enum skips them)
    others = [name for name, m in KVQuantMode.__members__.items() if m.value == KVQuantMode.CUSTOM.value
              and name != "CUSTOM"]
    if others:
        return [f"vLLM's KVQuantMode.CUSTOM is an alias of {', '.join(others)} (same value "
                f"{KVQuantMode.CUSTOM.value}); harmless for the OSCAR backend, fixed by "
                "python -m oscar_vllm.core --apply"]
    return []


def vllm_root() -> Path:
    """The folder that holds the installed ``vllm`` package (the patch's paths are relative to it)."""
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


def apply_patch(root: Path | None = None, dry_run: bool = False) -> None:
    """Apply ``vllm_core.patch`` under ``root`` (default: the installed vLLM), dry run first; raises with the
    output of ``patch`` when it does not apply cleanly."""
    root = Path(root) if root is not None else vllm_root()
    for check in (True, False) if not dry_run else (True,):
        args = ["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)] + (["--dry-run"] if check else [])
        done = subprocess.run(args, cwd=root, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{PATCH.name} does not apply under {root}:\n{done.stdout}{done.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the installed vLLM for what oscar-kv's plugin needs.")
    parser.add_argument("--apply", action="store_true", help=f"apply {PATCH.name} to the installed vLLM")
    args = parser.parse_args(argv)
    try:
        import vllm
    except ImportError:
        sys.stderr.write(f"vLLM is not installed here: pip install -e '.[vllm]' (vLLM {VERIFIED_VLLM}; its install "
                         "steps: docs/serving.md)\n")
        return 2
    lacks = missing()
    sys.stdout.write(f"vLLM {vllm.__version__} at {vllm_root()} (verified: {VERIFIED_VLLM})\n")
    sys.stdout.write("needs from the core: " + ("all present" if not lacks else "MISSING " + "; ".join(lacks)) + "\n")
    if args.apply and defects():
        apply_patch()
        sys.stdout.write(f"applied {PATCH}; restart Python for it to take effect\n")
        return 0
    for defect in defects():
        sys.stdout.write(f"defect: {defect}\n")
    return 1 if lacks else 0


if __name__ == "__main__":
    raise SystemExit(main())
