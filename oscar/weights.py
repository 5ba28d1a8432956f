"""Offline weight transforms shared by the rotating methods (OScaR, QuaRot, RotateKV, OSCAR)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from oscar.quant import hadamard_matrix


#: the marks a value fold leaves on the model (a second fold is refused or a no-op by them)
FOLD_MARKS = ("_oscar_value_hadamard_folded", "_oscar_value_rotation_folded")


def attention_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The self-attention modules of a decoder (anything with v_proj, o_proj and a head_dim)."""
    for module in model.modules():
        if all(hasattr(module, a) for a in ("v_proj", "o_proj", "head_dim")):
            yield module


@torch.no_grad()
def fold_value_hadamard(model: nn.Module) -> int:
    """Rotate every value head by H_D offline, leaving the model's function unchanged.

    v_proj rows of KV head h become H @ W_v[h] (bias likewise), so the cached values are H v_h;
    o_proj input columns of every query head become W_o[:, h] @ H, undoing it after attention
    (H is symmetric and orthogonal). Done in float64 on each weight's own device (a model split over GPUs
    keeps every layer where it is), stored back in each weight's dtype.
    Returns the number of attention modules changed; marks the model so a second call is a no-op.
    """
    if getattr(model, "_oscar_value_hadamard_folded", False):
        return 0
    count = 0
    for attn in attention_modules(model):
        d = attn.head_dim
        h = hadamard_matrix(d, torch.float64, attn.v_proj.weight.device)
        w_v = attn.v_proj.weight
        rotated = torch.einsum("ij,hjk->hik", h, w_v.double().view(-1, d, w_v.shape[1]))
        w_v.copy_(rotated.reshape(w_v.shape).to(w_v.dtype))
        if attn.v_proj.bias is not None:
            b = attn.v_proj.bias
            b.copy_((b.double().view(-1, d) @ h.T).reshape(b.shape).to(b.dtype))
        w_o = attn.o_proj.weight
        w_o.copy_((w_o.double().view(w_o.shape[0], -1, d) @ h.to(w_o.device)).reshape(w_o.shape).to(w_o.dtype))
        count += 1
    if count == 0:
        raise ValueError("found no attention module with v_proj/o_proj/head_dim to fold the value rotation into")
    model._oscar_value_hadamard_folded = True
    return count


@torch.no_grad()
def fold_value_rotation(model: nn.Module, rotations: torch.Tensor) -> int:
    """Rotate every value head by its layer's orthogonal matrix offline (row convention v -> v R).

    rotations [L, D, D], indexed by the attention module's ``layer_idx``. v_proj rows of KV head h
    become R^T @ W_v[h] (bias b_h @ R), so the cached values are v_h R; o_proj input columns of every
    query head become W_o[:, h] @ R, undoing it after attention (R R^T = I). Done in float64, stored
    back in each weight's dtype. Refuses a model whose values were already rotated (by this or
    :func:`fold_value_hadamard`): a second fold would change the quantized space silently.
    """
    if any(getattr(model, mark, False) for mark in FOLD_MARKS):
        raise ValueError("the value projections of this model are already rotated; load a fresh model")
    count = 0
    for attn in attention_modules(model):
        d = attn.head_dim
        r = rotations[attn.layer_idx].to(torch.float64).to(attn.v_proj.weight.device)
        if r.shape != (d, d):
            raise ValueError(f"layer {attn.layer_idx}: value rotation of shape {tuple(r.shape)}, head_dim is {d}")
        w_v = attn.v_proj.weight
        rotated = torch.einsum("ji,hjk->hik", r, w_v.double().view(-1, d, w_v.shape[1]))
        w_v.copy_(rotated.reshape(w_v.shape).to(w_v.dtype))
        if attn.v_proj.bias is not None:
            b = attn.v_proj.bias
            b.copy_((b.double().view(-1, d) @ r).reshape(b.shape).to(b.dtype))
        w_o = attn.o_proj.weight
        w_o.copy_((w_o.double().view(w_o.shape[0], -1, d) @ r).reshape(w_o.shape).to(w_o.dtype))
        count += 1
    if count == 0:
        raise ValueError("found no attention module with v_proj/o_proj/head_dim to fold the value rotation into")
    model._oscar_value_rotation_folded = True
    return count


def value_output_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a value fold changes: every attention module's v_proj and o_proj weights and biases, by name."""
    return {f"{i}.{proj}.{name}": p for i, attn in enumerate(attention_modules(model)) for proj in ("v_proj", "o_proj")
            for name, p in getattr(attn, proj).named_parameters()}


@torch.no_grad()
def restore_unfolded(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Undo any value fold: put back ``saved`` (copies of :func:`value_output_parameters` taken before one) and clear
    the fold marks, so the next method's ``prepare_model`` folds into the weights as loaded."""
    for key, p in value_output_parameters(model).items():
        p.copy_(saved[key])
    for mark in FOLD_MARKS:
        model.__dict__.pop(mark, None)
