"""Calibrate OSCAR's per-layer K and V rotations (methods/spectral.py) for one model.

    python scripts/calibrate_spectral.py --model smollm2-135m
    # -> results/calibration/smollm2-135m/spectral.pt, read by conf/method/spectral.yaml

For every layer: run the calibration text through the model in windows (full precision, one fresh
cache per window), record the queries, keys and values attention sees (post-RoPE, post-QK-norm; the
values before any rotation), then
  S_K = 1/H_kv sum_h Q_h^T Q_h / n  (Q_h: every query row of the query heads that read KV head h),
  S_V = 1/H_kv sum_h V_h^T diag(w_h) V_h / N,  w_h[t] = k_t (Q_h^T Q_h / n) k_t^T, mean 1 over the tokens,
and R = U . H_D . P_br from each one's eigenvectors (methods.spectral.spectral_rotation). Stored: fp32
rotations [L, D, D] for K and V, their eigenvalues, the text's name and the token count.

Calibration text: Wikipedia paragraphs of SQuAD 2.0 dev (../shared/data/qa), as for RotateKV: a text
no task of this project evaluates on (OSCAR calibrates on about 30K tokens of GPQA prompts; WikiText-2
train is not available offline and the test split is our perplexity text). Default 16 windows of 2048
tokens = 32768 tokens, close to OSCAR's 30000.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # `python scripts/calibrate_spectral.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from methods.spectral import query_covariance, spectral_rotation, weighted_value_covariance
from oscar import build_method
from oscar.atomic import torch_save
from oscar.attention import record_attention
from oscar.lm import KVModel
from oscar.paths import REPO_ROOT
from scripts.calibrate_rotatekv import squad_text

log = logging.getLogger(__name__)


@torch.no_grad()
def calibrate(model, tokenizer, text: str, windows: int = 16, seq_len: int = 2048) -> dict:
    """Per-layer rotations from ``windows`` consecutive windows of ``seq_len`` tokens of ``text``."""
    config = model.config.get_text_config()
    num_kv = config.num_key_value_heads
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() < windows * seq_len:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, {windows} x {seq_len} are needed")
    batch = ids[: windows * seq_len].view(windows, seq_len).to(next(model.parameters()).device)
    lm = KVModel(model, tokenizer, build_method("fp16"))
    q_sum: dict[int, torch.Tensor] = {}
    q_rows: dict[int, int] = {}
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    for window in tqdm(batch, desc="calibrate spectral", unit="window"):
        with record_attention(model) as records:
            model(window.unsqueeze(0), cache=lm.new_cache())
        for layer, calls in records.items():
            call = calls[0]  # query [1, H_q, T, D]; key, value [1, H_kv, T, D]: this window's tokens
            total, rows = query_covariance(call["query"], num_kv)
            q_sum[layer] = q_sum.get(layer, 0) + total
            q_rows[layer] = q_rows.get(layer, 0) + rows
            keys.setdefault(layer, []).append(call["key"][0].transpose(0, 1).float().cpu())  # [T, H_kv, D]
            values.setdefault(layer, []).append(call["value"][0].transpose(0, 1).float().cpu())
    k_rot, v_rot, k_eig, v_eig = [], [], [], []
    for layer in sorted(q_sum):
        query_cov = q_sum[layer].cpu() / q_rows[layer]  # [H_kv, D, D], mean q^T q per KV head
        value_cov = weighted_value_covariance(torch.cat(keys.pop(layer)), torch.cat(values.pop(layer)), query_cov)
        for cov, rotations, eigenvalues in ((query_cov.mean(0), k_rot, k_eig), (value_cov.mean(0), v_rot, v_eig)):
            r, e = spectral_rotation(cov)
            rotations.append(r.float())
            eigenvalues.append(e.float())
    return dict(k_rotation=torch.stack(k_rot), v_rotation=torch.stack(v_rot), k_eigenvalues=torch.stack(k_eig),
                v_eigenvalues=torch.stack(v_eig), windows=windows, seq_len=seq_len, tokens=windows * seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a registered model (conf/model/*.yaml)")
    parser.add_argument("--out", default=None, help="default: results/calibration/<model>/spectral.pt")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from oscar.models import load_model

    model, tokenizer = load_model(args.model, device=args.device)
    start = time.perf_counter()
    result = calibrate(model, tokenizer, squad_text(), args.windows, args.seq_len)
    result.update(model=args.model, text="SQuAD 2.0 dev paragraphs", seconds=round(time.perf_counter() - start, 1))
    out = Path(args.out) if args.out else REPO_ROOT / "results" / "calibration" / args.model / "spectral.pt"
    out = out if out.is_absolute() else REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_save(result, out)  # whole or absent: a run never reads a calibration cut short
    log.info("wrote %s: %d layers, head_dim %d, %d tokens, %.1f s (runs read it: method=spectral model=%s)", out,
             *result["k_rotation"].shape[:2], result["tokens"], result["seconds"], args.model)


if __name__ == "__main__":
    main()
