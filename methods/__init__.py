"""One module per KV-cache quantization method; importing the package registers them all."""

from methods import fp16, kivi, oscar  # noqa: F401  (registration side effects)
