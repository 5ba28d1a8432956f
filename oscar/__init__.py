"""OScaR-KV: extreme KV-cache quantization (OScaR and its baselines) behind one interface."""

from oscar.method import KVMethod, available_methods, build_method, method_class, register_method
from oscar.quant import PackedTensor

__all__ = ["KVMethod", "PackedTensor", "apply", "available_methods", "build_method", "method_class",
           "register_method"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``oscar.apply`` (oscar.dropin.apply), imported on first use: it brings in transformers."""
    if name == "apply":
        from oscar.dropin import apply

        return apply
    raise AttributeError(f"module 'oscar' has no attribute {name!r}")
