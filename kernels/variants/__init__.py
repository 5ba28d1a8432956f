"""One module per method's kernel variant (kernels.variant.KernelVariant), registered under the method's name with
``@register_variant``; imported on the first lookup of kernels.variant.KERNELS."""
