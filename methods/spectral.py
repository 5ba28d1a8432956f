"""OSCAR: Offline Spectral Covariance-Aware Rotation for 2-bit KV-cache quantization
(Zhou et al. 2026, arXiv 2605.17757; public code FutureMLS-Lab/OSCAR, an SGLang fork).

Offline, per layer l, from Q/K/V captured on calibration text (scripts/calibrate_spectral.py):
  1. key covariance seen by the queries, GQA-aware: S_K = 1/H_kv sum_h Q_h^T Q_h / n, where Q_h stacks
     every query (all tokens, all query heads) that reads KV head h;
  2. value covariance weighted by attention scores: S_V = 1/H_kv sum_h V_h^T diag(w_h) V_h / n, with
     w_h[t] = k_t (Q_h^T Q_h / n) k_t^T normalized to mean 1 over the tokens;
  3. eigh(S) -> eigenvectors U (columns, ascending eigenvalues);
  4. R = U . H_D . P_br: H_D the head-dim Walsh-Hadamard matrix, P_br the permutation that puts the
     directions in decreasing eigenvalue order at bit-reversed positions (spreads the high-variance
     directions over the quantization groups); one fp32 orthogonal [D, D] matrix per layer, for K and V.
Online, in the row-vector convention x -> x R:
  5. keys: k -> k R_K and queries q -> q R_K (so q.k is unchanged); values: R_V absorbed offline into
     v_proj (rows of KV head h -> R_V^T W_v[h]) and o_proj (columns of query head h -> W_o[:, h] R_V);
  6. clip each (token, head) row of D values at the ratio-quantile of |x|: the value of index
     int(ratio * D) (capped at D - 1) of the sorted |x| (K 0.96, V 0.92);
  7. per-token groups of G channels (G = 128, or D if smaller), asymmetric INT2 with fp32 scale and
     zero: s = (max - min)/3, x_hat = q s + min; or (``codebook=lloyd_max``) the 4-level Lloyd-Max
     quantizer of the group's standardized values, x_hat = mean + std * level[q] (defined at 2 bits only: other
     widths are refused; the uniform quantizer takes any width b with 2^b levels);
  8. the first ``sink_tokens`` (64) tokens of every sequence stay exact, and the ``window`` flush
     keeps the most recent R = 256 tokens of K and V in full precision.
Choices that are ours (the public description leaves them open; each is a field):
  - Q and K are what attention sees: post-RoPE, post-QK-norm (the keys the cache receives);
    calibration text and token count are recorded in the calibration file.
  - One rotation per layer shared by its KV heads (the README's default; a per-head variant exists for
    one model there and is not implemented).
  - The uniform quantizer is our shared one with a float zero (x_hat = q s + min, rounding half to
    even); the released kernel stores zero = -min/s and rounds half up: the same grid.
  - Lloyd-Max statistics are per group (the released kernel only has one group per row, G = D);
    ``lloyd_max_levels="released"`` reconstructs with the uniform-equivalent levels of the released
    kernel (+-0.584, +-1.751 std: LM_RATIO 1.16), ``"exact"`` with the Lloyd-Max centroids of N(0, 1)
    (+-0.453, +-1.510 std); the cell edges (0, +-0.98 std) are the Lloyd-Max ones in both.
  - Sink tokens are kept in the model dtype, rotated; their (unread) codes are stored too.
  - The recent window holds exactly the last R tokens (the released pool demotes tokens in batches of
    its flush interval, so it holds R to R + interval - 1).
Stored per chunk: codes [B, H, T, D/4] (uint8), scale and zero [B, H, T, D/G] (fp32), plus the sink
tokens [B, H, S, D] and their int32 stream indices; nbytes counts them all. The rotations are per-model
constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from oscar.exact import restore_exact, with_kept
from oscar.method import (FlushPolicy, KVMethod, ServedModels, TokenSpan, attention_shape, check_calibrated_model,
                          read_calibration, register_method)
from oscar.options import bounded
from oscar.paths import calibration_command, calibration_file, calibration_location
from oscar.quant import (PackedTensor, dequantize_groups, hadamard_matrix, is_power_of_two, lloyd_max_gaussian,
                         norm_scale, pack_bits, quantize_groups, unpack_bits)
from oscar.weights import fold_value_rotation

#: reconstruction levels of the released Lloyd-Max path, in standard deviations: uniform steps over
#: +-1.16 x the outer Lloyd-Max centroid (1.5096 in the released constants)
RELEASED_LLOYD_MAX_LEVELS = tuple(1.16 * 1.5095585584640503 * (2 * q / 3 - 1) for q in range(4))


# ----------------------------------------------------------------------------- the rotation


def bit_reversal(d: int) -> Tensor:
    """br[i] = i with its log2(d) bits reversed: [d] long (d a power of two)."""
    bits = d.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(d)])


def spectral_rotation(covariance: Tensor) -> tuple[Tensor, Tensor]:
    """R = U H_D P_br for a symmetric covariance [D, D] -> (R [D, D] float64, eigenvalues [D], ascending).

    Column br[i] of x R is column sorted[i] of x U H_D, sorted = the eigen-indices by decreasing eigenvalue.
    """
    d = covariance.shape[-1]
    cov = covariance.double()
    eigenvalues, u = torch.linalg.eigh((cov + cov.T) / 2)
    order = torch.argsort(eigenvalues, descending=True)
    perm = torch.empty(d, dtype=torch.long)
    perm[bit_reversal(d)] = order
    return (u @ hadamard_matrix(d, torch.float64))[:, perm], eigenvalues


def query_covariance(q: Tensor, num_kv_heads: int) -> Tensor:
    """Per KV head, the second moment of the queries that read it: q [B, H_q, T, D] -> sum [H_kv, D, D], count.

    Returns (sum over tokens and the group's query heads of q^T q in float64 [H_kv, D, D], number of rows).
    """
    b, h_q, t, d = q.shape
    grouped = q.double().view(b, num_kv_heads, h_q // num_kv_heads, t, d).transpose(1, 0).reshape(num_kv_heads, -1, d)
    return grouped.transpose(1, 2) @ grouped, grouped.shape[1]


def weighted_value_covariance(k: Tensor, v: Tensor, query_cov: Tensor) -> Tensor:
    """S_V per KV head: k, v [N, H_kv, D] (tokens stacked), query_cov [H_kv, D, D] (mean q^T q) -> [H_kv, D, D].

    w[t] = k_t C_h k_t^T, normalized to mean 1 over the tokens; S_V = sum_t w[t] v_t^T v_t / N.
    """
    k, v = k.double().transpose(0, 1), v.double().transpose(0, 1)  # [H, N, D]
    w = ((k @ query_cov.double()) * k).sum(-1)  # [H, N]
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-12) * k.shape[1]
    return (v * w.unsqueeze(-1)).transpose(1, 2) @ v / k.shape[1]


def clip_rows(x: Tensor, ratio: float) -> Tensor:
    """Clamp every row of x [..., D] to +-t, t = the value of index int(ratio * D) (<= D - 1) of the sorted |row|."""
    if ratio <= 0:
        return x
    d = x.shape[-1]
    index = min(int(ratio * d), d - 1)
    threshold = x.abs().sort(dim=-1).values[..., index:index + 1]
    return torch.maximum(torch.minimum(x, threshold), -threshold)


# ----------------------------------------------------------------------------- the method


@register_method("spectral")
@dataclass
class Spectral(KVMethod):
    uses_hadamard = True
    uses_span = True  # the sink tokens kept exactly are found by their stream index (span.start)

    group_size: int = 128
    residual_length: int = 256
    flush: FlushPolicy = "window"
    #: per (token, head) quantile clip of |x| before quantization (<= 0: off)
    k_clip_ratio: float = bounded(0.96, le=1)
    v_clip_ratio: float = bounded(0.92, le=1)
    #: tokens at the start of every sequence kept exactly (the BF16 sink prefix)
    sink_tokens: int = bounded(64, ge=0)
    codebook: Literal["uniform", "lloyd_max"] = "uniform"
    lloyd_max_levels: Literal["released", "exact"] = "released"
    #: the file scripts/calibrate_spectral.py writes (relative paths: from the repository root)
    calibration: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.codebook == "lloyd_max" and {self.k_bits, self.v_bits} - {2, 16}:
            raise ValueError("spectral: the Lloyd-Max codebook is the INT2 one: k_bits and v_bits must be 2 (or 16)")
        self._k_rotation: Tensor | None = None  # [L, D, D] float32
        self._v_rotation: Tensor | None = None
        self._served = ServedModels()  # the models these rotations serve (one shape and device)

    def group(self, head_dim: int) -> int:
        """Channels per quantization group: group_size, or the head dim if smaller."""
        return min(self.group_size, head_dim)

    # -- offline -----------------------------------------------------------------------------
    def check_model(self, head_dim: int, num_kv_heads: int) -> None:
        if not is_power_of_two(head_dim):
            raise ValueError("spectral composes its rotation with a Hadamard matrix: head_dim must be a power of two, "
                             f"got {head_dim}")
        if head_dim % self.group(head_dim):
            raise ValueError(f"spectral: group_size={self.group_size} must divide head_dim={head_dim}")
        self.calibration_path()  # a missing file fails here, before the model is loaded

    def check_config(self, config, model: str | None = None) -> None:
        """Also the calibration file: opened and its rotations checked against the model, before the weights load."""
        super().check_config(config, model)
        self.load_calibration(config.get_text_config().num_hidden_layers, attention_shape(config)[0], model)

    def calibration_path(self, model: str | None = None) -> Path:
        if not self.calibration:
            raise ValueError("spectral needs `calibration`, the file written by scripts/calibrate_spectral.py")
        return calibration_file("spectral", self.calibration, model or self._calibrated_model())

    def data_files(self) -> list[Path]:
        """The calibration file (its contents are part of a run's identity)."""
        return [calibration_location(self.calibration)] if self.calibration else []

    def _calibrated_model(self) -> str:
        """The model a calibration file is for, by its folder (results/calibration/<model>/spectral.pt)."""
        folder = Path(self.calibration).parent.name
        return folder if folder not in ("", "calibration") else "<model>"

    def load_calibration(self, num_layers: int, head_dim: int, model: str | None = None) -> dict:
        """The calibration file's ``k_rotation`` / ``v_rotation`` [num_layers, D, D] (``model``: the run's model,
        named in the errors); a file that cannot be read or was made for another model shape is a ValueError naming
        it and the command that makes the right one."""
        path = self.calibration_path(model)
        fix = calibration_command("spectral", self.calibration, model or self._calibrated_model())
        calib = read_calibration("spectral", path, fix, ("k_rotation", "v_rotation"))
        shape = (num_layers, head_dim, head_dim)
        found = [tuple(getattr(calib[k], "shape", ())) for k in ("k_rotation", "v_rotation")]
        if found != [shape, shape]:
            made_for = f" (made for {calib['model']})" if "model" in calib else ""
            remake = calibration_command("spectral", None, model or "<model>")  # its default file, not this one
            raise ValueError(f"spectral: {path}{made_for} holds rotations {found[0]}, the model"
                             f"{'' if model is None else ' ' + model} needs {shape}; point method.calibration at its "
                             f"file, or make it with {remake}")
        check_calibrated_model("spectral", path, calib, model)
        return calib

    def prepare_model(self, model: nn.Module) -> None:
        """Load the per-layer rotations (once for every model of one shape and device this object serves:
        :class:`ServedModels`), fold R_V into v_proj / o_proj."""
        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check_model(head_dim, config.num_key_value_heads)
        device = next(model.parameters()).device
        if self._served.admit(self, model, (config.num_hidden_layers, head_dim, str(device))):
            calib = self.load_calibration(config.num_hidden_layers, head_dim)
            self._k_rotation = calib["k_rotation"].float().to(device)
            self._v_rotation = calib["v_rotation"].float().to(device)
        fold_value_rotation(model, self._v_rotation)

    def release_model(self, model: nn.Module) -> None:
        self._served.discard(model)

    # -- online ------------------------------------------------------------------------------
    def key_rotation(self, layer_idx: int) -> Tensor:
        """R_K of layer ``layer_idx``: [D, D] float32 on the prepared model's device (keys and queries x -> x R_K)."""
        if self._k_rotation is None:
            raise RuntimeError("spectral: call prepare_model(model) first (the rotations come from the calibration)")
        return self._k_rotation[layer_idx]

    def _rotate(self, x: Tensor, layer_idx: int) -> Tensor:
        return (x.float() @ self.key_rotation(layer_idx).to(x.device)).to(x.dtype)

    def transform_query(self, q: Tensor, layer_idx: int) -> Tensor:
        return self._rotate(q, layer_idx)

    def transform_key(self, k: Tensor, layer_idx: int) -> Tensor:
        return self._rotate(k, layer_idx)

    def quantize_keys(self, k: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        return self._quantize(self._rotate(k, layer_idx), self.k_bits, self.k_clip_ratio, span)

    def quantize_rotated_keys(self, k_rot: Tensor, span: TokenSpan | None = None) -> PackedTensor:
        """``quantize_keys`` of keys already rotated (as transform_key leaves them: what a cache's window holds)."""
        self.check_input(k_rot, "keys")
        return self._quantize(k_rot, self.k_bits, self.k_clip_ratio, span)

    def quantize_values(self, v: Tensor, layer_idx: int, span: TokenSpan | None = None) -> PackedTensor:
        return self._quantize(v, self.v_bits, self.v_clip_ratio, span)

    def _quantize(self, x: Tensor, bits: int, clip_ratio: float, span: TokenSpan | None) -> PackedTensor:
        """x [B, H, T, D] in the rotated space -> codes + fp32 group parameters + the exact sink tokens."""
        b, h, t, d = x.shape
        g = self.group(d)
        if bits == 16:
            packed = quantize_groups(x, 16, g, "token")
        elif self.codebook == "uniform":
            packed = quantize_groups(clip_rows(x.float(), clip_ratio), bits, g, "token", "float",
                                     param_dtype=torch.float32)
            packed.dtype = x.dtype
        else:
            packed = self._quantize_lloyd_max(clip_rows(x.float(), clip_ratio), x.dtype, g)
        start = 0 if span is None else span.start  # an int, or [B] per row (a flush inside the decode step)
        stream = torch.arange(t, device=x.device) + (start.view(-1, 1) if isinstance(start, Tensor) else start)
        sinks = (stream < self.sink_tokens).expand(b, t).unsqueeze(1)
        return with_kept(packed, x, sinks, span)

    def reconstruction_levels(self, device=None) -> Tensor:
        """The INT2 Lloyd-Max reconstruction levels [4] in std units (``lloyd_max_levels``' choice)."""
        return self._levels(device)[1]

    def _levels(self, device) -> tuple[Tensor, Tensor]:
        """(cell edges [3], reconstruction levels [4]) of the INT2 Lloyd-Max quantizer, in std units."""
        centroids = torch.tensor(lloyd_max_gaussian(2), dtype=torch.float32, device=device)
        edges = (centroids[1:] + centroids[:-1]) / 2
        if self.lloyd_max_levels == "released":
            return edges, torch.tensor(RELEASED_LLOYD_MAX_LEVELS, dtype=torch.float32, device=device)
        return edges, centroids

    def _quantize_lloyd_max(self, x: Tensor, dtype: torch.dtype, g: int) -> PackedTensor:
        b, h, t, d = x.shape
        groups = x.view(b, h, t, d // g, g)
        mean = groups.mean(-1, keepdim=True)
        centered = groups - mean
        scale = norm_scale(centered, -1).clamp(min=1)  # 1 but for huge groups, whose squares would overflow
        std = ((centered / scale).square().mean(-1, keepdim=True) + 1e-8 / scale.square()).sqrt() * scale
        edges, _ = self._levels(x.device)
        codes = torch.bucketize((groups - mean) / std, edges, right=True).view(b, h, t, d)
        buffers = {"codes": pack_bits(codes.to(torch.uint8), 2), "std": std.squeeze(-1), "mean": mean.squeeze(-1)}
        meta = dict(bits=2, group_size=g, axis="token", codebook="lloyd_max")
        return PackedTensor(buffers, (b, h, t, d), dtype, meta)

    def dequantize(self, packed: PackedTensor) -> Tensor:
        if packed.meta.get("codebook") == "lloyd_max":
            b, h, t, d = packed.shape
            g = packed.meta["group_size"]
            _, levels = self._levels(packed.buffers["codes"].device)
            z = levels[unpack_bits(packed.buffers["codes"], 2, d).long()].view(b, h, t, d // g, g)
            x = (packed.buffers["mean"].unsqueeze(-1) + packed.buffers["std"].unsqueeze(-1) * z).view(b, h, t, d)
        else:
            x = dequantize_groups(packed, torch.float32)
        return restore_exact(x.to(packed.dtype), packed.buffers, packed.start)
