"""Fused decode-step layers: a model's RMSNorms, RoPE and SiLU MLPs run as one kernel launch each (kernels.layers)
while a :class:`LayerFusion` is active, and are put back exactly on exit; with ``merge``, each layer's q/k/v and
gate/up projections also run as one GEMM each. No modeling code is copied: modules are swapped for fused ones that
hold the same parameters, and one module-level function and each decoder layer's forward (the pre-norm residual
block's five steps, written here) are patched for the scope.

What is swapped (by exact type: a subclass may compute otherwise; the architectures tested against transformers'
own modules, tests/test_fused_layers_emulated.py):

    LlamaRMSNorm, Qwen3RMSNorm  -> FusedRMSNorm (Qwen3's per-head q_norm / k_norm too)
    LlamaMLP, Qwen3MLP (SiLU)   -> FusedMLP: down_proj(silu_mul(gate_proj(x), up_proj(x)))
    apply_rotary_pos_emb        -> kernels.layers.rotary (q and k in one launch), in modeling_llama / modeling_qwen3
    LlamaDecoderLayer, Qwen3DecoderLayer forward
                                -> the same forward (its five steps: norm, attention, add, norm, MLP and add) with
                                   the attention's residual add and the post-attention norm as one launch
                                   (kernels.layers.add_rms_norm), the instance's forward for the scope
    q_proj, k_proj, v_proj      -> (merge) ProjectionSlice: one GEMM of the merged rows, sliced

RoPE: transformers 5.24's attention forwards call their modeling file's module-level ``apply_rotary_pos_emb`` by
name. Its other hooks do not reach that call here: ``use_kernelized_func`` and the kernel hub mapping act only with
the hub's ``kernels`` package (not installed, and its import name is this repository's own ``kernels`` package) and
swap for the whole process once a model is kernelized; the attention module holds no attribute for it. So the
module-level name is patched for the scope of :meth:`LayerFusion.active` only (the decode step, which the engine
runs and captures inside that scope) and restored on exit; the patched function hands whatever it does not take
(another ``unsqueeze_dim``, partial rotary dims, mixed dtypes) to the original.

Merged projections (``merge``): the rows of q/k/v (and of gate/up) become views of one tensor per layer, the same
Parameter objects holding the same values (no extra memory; the unfused model computes what it computed), and
:meth:`LayerFusion.remove` gives each its own storage back. Inside the scope the q projection runs the merged GEMM and
k and v take their slices of it (of the same input tensor, unmodified since: else each runs its own rows), so the
attention forward is untouched. A parameter moved since (``.to``, a reassigned ``.data``) is merged again on entry.

Numbers (tests/test_fused_layers_emulated.py): RoPE and the residual add are bit-equal to transformers'; the norm
(alone or after the add) and the SiLU product keep its formula and roundings (fp32 sums in another order: within a
small multiple of plain torch's error against float64); a merged GEMM sums each output in cuBLAS's order for the
merged shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from kernels import layers

#: the norm and MLP classes whose forward is what kernels.layers computes (exact types)
NORMS = (modeling_llama.LlamaRMSNorm, modeling_qwen3.Qwen3RMSNorm)
MLPS = (modeling_llama.LlamaMLP, modeling_qwen3.Qwen3MLP)
#: attention classes -> their modeling file, whose ``apply_rotary_pos_emb`` the scope patches
ATTENTIONS = {modeling_llama.LlamaAttention: modeling_llama, modeling_qwen3.Qwen3Attention: modeling_qwen3}
#: the functions as transformers defines them (a name found patched by someone else is left alone)
ROPE_FUNCTIONS = {module: module.apply_rotary_pos_emb for module in ATTENTIONS.values()}
#: decoder layers whose forward is a pre-norm attention and MLP, each with its residual add (exact types): in the
#: scope their forward runs the attention's residual add and the post-attention norm as one launch
DECODER_LAYERS = (modeling_llama.LlamaDecoderLayer, modeling_qwen3.Qwen3DecoderLayer)
#: the text models' ``model_type`` whose layers are the classes above
MODEL_TYPES = ("llama", "qwen3")


class FusedRMSNorm(nn.Module):
    """transformers' RMSNorm in one launch (kernels.layers.rms_norm), holding the norm's own weight Parameter; an input
    in another dtype than the weight goes to the original module (torch's type promotion)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        object.__setattr__(self, "original", norm)  # not a submodule: the state dict stays the norm's

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype:
            return self.original(x)
        return layers.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class MergedRows:
    """The weights (and biases) of Linear layers over one input as row blocks of one tensor: ``weight`` [sum of
    out_features, in_features], each layer's Parameter a view of its block."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.bounds = [0]
        for linear in linears:
            self.bounds.append(self.bounds[-1] + linear.out_features)
        self.merge()

    @staticmethod
    def mergeable(linears: list[nn.Linear]) -> bool:
        """One dtype and device, contiguous weights, biases on all or none."""
        weights = [linear.weight for linear in linears]
        return (len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1 and all(w.is_contiguous() for w in weights)
                and len({linear.bias is None for linear in linears}) == 1)

    @torch.no_grad()
    def merge(self) -> None:
        self.weight = self._merge([linear.weight for linear in self.linears])
        has_bias = self.linears[0].bias is not None
        self.bias = self._merge([linear.bias for linear in self.linears]) if has_bias else None

    @staticmethod
    def _merge(params: list[nn.Parameter]) -> Tensor:
        merged = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = merged[start:start + p.shape[0]]
            start += p.shape[0]
        return merged

    def intact(self) -> bool:
        """Whether every parameter is still the view of its block (not moved or reassigned since)."""
        for name, merged in (("weight", self.weight), ("bias", self.bias)):
            if merged is None:
                continue
            row_bytes = merged.stride(0) * merged.element_size()
            for i, linear in enumerate(self.linears):
                p = getattr(linear, name)
                rows = self.bounds[i + 1] - self.bounds[i]
                if (p is None or p.dtype != merged.dtype or p.shape != (rows, *merged.shape[1:])
                        or p.data_ptr() != merged.data_ptr() + self.bounds[i] * row_bytes):
                    return False
        return True

    @torch.no_grad()
    def split(self) -> None:
        """Each parameter its own storage again (the same values)."""
        for linear in self.linears:
            for p in (linear.weight, linear.bias):
                if p is not None:
                    p.data = p.data.clone()
        self.weight = self.bias = None

    def linear(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedMLP(nn.Module):
    """A SiLU MLP as down_proj(silu_mul(gate, up)) (kernels.layers.silu_mul), its own projections; with ``merged``
    (gate and up as one MergedRows) gate and up come from one GEMM."""

    def __init__(self, mlp: nn.Module, merged: MergedRows | None = None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.merged = merged

    def forward(self, x: Tensor) -> Tensor:
        if self.merged is None:
            return self.down_proj(layers.silu_mul(self.gate_proj(x), self.up_proj(x)))
        both = self.merged.linear(x)
        split = self.merged.bounds[1]
        return self.down_proj(layers.silu_mul(both[..., :split], both[..., split:]))


class SharedGemm:
    """The merged GEMM of one input, computed once for the projections that slice it: the output of the last input
    (the same tensor object at the same version) is reused, any other input computes its own."""

    def __init__(self, merged: MergedRows):
        self.merged = merged
        self.release()

    def __call__(self, x: Tensor) -> Tensor:
        if self.input is not x or self.version != x._version:
            self.input, self.version, self.output = x, x._version, self.merged.linear(x)
        return self.output

    def release(self) -> None:
        self.input = self.version = self.output = None


class ProjectionSlice(nn.Module):
    """One projection (``index`` of a MergedRows) as its slice of the shared GEMM; ``last``: the GEMM's output is
    released after it (v_proj: the attention forward calls q, k, v in that order)."""

    def __init__(self, linear: nn.Linear, shared: SharedGemm, index: int, last: bool):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.shared, self.last = shared, last
        self.start, self.stop = shared.merged.bounds[index], shared.merged.bounds[index + 1]

    def forward(self, x: Tensor) -> Tensor:
        out = self.shared(x)[..., self.start:self.stop]
        if self.last:
            self.shared.release()
        return out


def fused_rope(original):
    """``original`` (a modeling file's apply_rotary_pos_emb) with q and k rotated by one launch where it takes them."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1]
                or k.shape[-1] != q.shape[-1] or len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1):
            return original(q, k, cos, sin, unsqueeze_dim)
        return layers.rotary(q, k, cos, sin)

    return apply_rotary_pos_emb


def fused_decoder_forward(layer: nn.Module):
    """The forward of ``layer`` (one of DECODER_LAYERS) with the attention's residual add and the post-attention
    RMSNorm in one launch (kernels.layers.add_rms_norm): transformers' forward, its operations in its order, the add
    and the norm rounded as it rounds them. The class's forward takes what this does not (positional arguments after
    the hidden states, a post-attention norm not swapped for the fused one, an attention output in another dtype)."""
    original = type(layer).forward.__get__(layer)

    def forward(hidden_states: Tensor, *args, **kwargs) -> Tensor:
        norm = layer.post_attention_layernorm
        if args or not isinstance(norm, FusedRMSNorm):
            return original(hidden_states, *args, **kwargs)
        residual = hidden_states
        hidden_states, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        if hidden_states.dtype != norm.weight.dtype or residual.dtype != norm.weight.dtype:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        else:
            residual, hidden_states = layers.add_rms_norm(hidden_states, residual, norm.weight,
                                                          norm.variance_epsilon)
        return residual + layer.mlp(hidden_states)

    return forward


class LayerFusion:
    """The fused layers of ``model`` (module docstring), prepared once: :meth:`active` swaps them in for a scope,
    :meth:`remove` undoes the merges. For a model on one device (the engine fuses no model split over GPUs)."""

    @staticmethod
    def supports(config) -> bool:
        """Whether a model of this transformers config has layers to fuse (its text model one of MODEL_TYPES)."""
        return config is not None and config.get_text_config().model_type in MODEL_TYPES

    def __init__(self, model: nn.Module, merge: bool = False):
        self.model, self.merge = model, merge
        self.swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []  # (parent, name, original, fused)
        self.merged: list[MergedRows] = []
        self.rope_files = []
        self.decoders = [m for m in model.modules() if type(m) in DECODER_LAYERS]
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                fused = self._fused(child)
                if fused is not None:
                    self.swaps.append((parent, name, child, fused))
            if type(parent) in ATTENTIONS and ATTENTIONS[type(parent)] not in self.rope_files:
                self.rope_files.append(ATTENTIONS[type(parent)])
        self._active = False

    def _fused(self, child: nn.Module) -> nn.Module | None:
        if type(child) in NORMS:
            return FusedRMSNorm(child)
        if type(child) in MLPS and isinstance(child.act_fn, SiLUActivation):
            pair = [child.gate_proj, child.up_proj]
            return FusedMLP(child, self._merged(pair) if self.merge and MergedRows.mergeable(pair) else None)
        if type(child) in ATTENTIONS and self.merge:
            projections = [child.q_proj, child.k_proj, child.v_proj]
            if MergedRows.mergeable(projections):
                shared = SharedGemm(self._merged(projections))
                for i, (name, linear) in enumerate(zip(("q_proj", "k_proj", "v_proj"), projections)):
                    self.swaps.append((child, name, linear, ProjectionSlice(linear, shared, i, last=i == 2)))
        return None

    def _merged(self, linears: list[nn.Linear]) -> MergedRows:
        merged = MergedRows(linears)
        self.merged.append(merged)
        return merged

    @contextlib.contextmanager
    def active(self) -> Iterator["LayerFusion"]:
        """The fused layers in place for the block (re-entrant: an inner scope changes nothing); everything as it
        was on exit."""
        if self._active:
            yield self
            return
        for merged in self.merged:
            if not merged.intact():
                merged.merge()
        swapped, patched = [], []
        self._active = True
        try:
            for parent, name, original, fused in self.swaps:
                if getattr(parent, name) is original:  # replaced by someone else since: left alone
                    setattr(parent, name, fused)
                    swapped.append((parent, name, original))
            for file in self.rope_files:
                if file.apply_rotary_pos_emb is ROPE_FUNCTIONS[file]:
                    file.apply_rotary_pos_emb = fused_rope(ROPE_FUNCTIONS[file])
                    patched.append(file)
            for layer in self.decoders:
                if "forward" not in layer.__dict__:  # an instance forward set by someone else: left alone
                    layer.forward = fused_decoder_forward(layer)
                    patched.append(layer)
            yield self
        finally:
            for patch in patched:
                if isinstance(patch, nn.Module):
                    del patch.forward
                else:
                    patch.apply_rotary_pos_emb = ROPE_FUNCTIONS[patch]
            for parent, name, original in reversed(swapped):
                setattr(parent, name, original)
            for *_, fused in self.swaps:
                if isinstance(fused, ProjectionSlice):
                    fused.shared.release()
            self._active = False

    def remove(self) -> None:
        """Undo the merges, every parameter its own storage again: the model exactly as it was given (the fusion
        swaps nothing after)."""
        if self._active:
            raise RuntimeError("LayerFusion.remove inside its active scope")
        for merged in self.merged:
            merged.split()
        self.merged.clear()
        self.swaps.clear()
        self.rope_files.clear()
        self.decoders.clear()
