"""One module per KV-cache quantization method; the method registry (oscar.method.METHODS) imports each on its
first lookup, which runs its ``@register_method``."""
