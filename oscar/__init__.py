"""OScaR-KV: extreme KV-cache quantization (OScaR and its baselines) behind one interface."""

from oscar.method import KVMethod, available_methods, build_method, method_class, register_method
from oscar.quant import PackedTensor

__all__ = ["KVMethod", "PackedTensor", "available_methods", "build_method", "method_class", "register_method"]
__version__ = "0.1.0"
