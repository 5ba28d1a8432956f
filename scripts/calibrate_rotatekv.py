"""Calibrate RotateKV's channel permutation for one model and store it under results/calibration/.

    python scripts/calibrate_rotatekv.py --model smollm2-135m
    # -> results/calibration/rotatekv_smollm2-135m.pt, read by conf/method/rotatekv.yaml

For every layer: run the calibration text through the model, take the keys before RoPE (the
cached post-RoPE keys with RoPE undone at their positions, so QK-norm is included where the model
has one), rotate them with the grouped-head Hadamard, sum every channel over all tokens, and sort
the H*D channels by that sum, ascending (as RotateKV's released calibration does). The order of the
unrotated keys is stored too (for ``reorder_first``).

Calibration text: Wikipedia paragraphs of SQuAD 2.0 dev (qa/ in the data folder), a text no task of this
project evaluates on (RotateKV calibrates on WikiText-2, our perplexity text).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from methods.rotatekv import OTHER_METHODS, effective_head_group, grouped_head_hadamard
from oscar import build_method
from oscar.atomic import torch_save
from oscar.attention import record_attention
from oscar.lm import KVModel
from oscar.paths import REPO_ROOT, data_file
from oscar.rope import layer_types, rope_tables, rotary_module, undo_rope

log = logging.getLogger(__name__)

SQUAD = "qa/ruler_squad_v2_dev.json"  # in the data folder (oscar.paths)


def squad_text(path: str | Path = SQUAD) -> str:
    """The distinct Wikipedia paragraphs of SQuAD 2.0 dev, in file order, joined by blank lines."""
    data = json.loads(data_file(path).read_text())["data"]
    seen, paragraphs = set(), []
    for article in data:
        for p in article["paragraphs"]:
            if p["context"] not in seen:
                seen.add(p["context"])
                paragraphs.append(p["context"])
    return "\n\n".join(paragraphs)


@torch.no_grad()
def calibrate(model, tokenizer, text: str, windows: int = 8, seq_len: int = 512, head_group: int = 4) -> dict:
    """Per-layer channel orders from ``windows`` consecutive windows of ``seq_len`` tokens of ``text``."""
    config = model.config.get_text_config()
    num_kv = config.num_key_value_heads
    group = effective_head_group(head_group, num_kv)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() < windows * seq_len:
        raise ValueError(f"the calibration text has {ids.numel()} tokens, {windows} x {seq_len} are needed")
    batch = ids[: windows * seq_len].view(windows, seq_len).to(next(model.parameters()).device)
    lm = KVModel(model, tokenizer, build_method("fp16"))
    rotary = rotary_module(model, "rotatekv", OTHER_METHODS)
    types = layer_types(model)
    sums_rotated, sums_plain = {}, {}
    for window in tqdm(batch, desc="calibrate rotatekv", unit="window"):
        with record_attention(model) as records:
            model(window.unsqueeze(0), cache=lm.new_cache())
        for layer, calls in records.items():
            key = calls[0]["key"].float()  # [1, H, T, D], post-RoPE, positions 0..T-1
            cos, sin = rope_tables(rotary, torch.arange(key.shape[2], device=key.device), key.shape[-1],
                                   None if types is None else types[layer])
            k_pre = undo_rope(key, cos, sin)
            for sums, k in ((sums_plain, k_pre), (sums_rotated, grouped_head_hadamard(k_pre, group))):
                channel_sum = k.transpose(1, 2).reshape(-1, k.shape[1] * k.shape[3]).sum(0)
                sums[layer] = sums.get(layer, 0) + channel_sum
    layers = sorted(sums_rotated)
    return dict(
        order_after_rotation=torch.stack([torch.argsort(sums_rotated[i]) for i in layers]).int().cpu(),
        order_before_rotation=torch.stack([torch.argsort(sums_plain[i]) for i in layers]).int().cpu(),
        head_group=group, windows=windows, seq_len=seq_len, tokens=windows * seq_len,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a registered model (conf/model/*.yaml)")
    parser.add_argument("--out", default=None, help="default: results/calibration/rotatekv_<model>.pt")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--head-group", type=int, default=4)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from oscar.models import load_model

    model, tokenizer = load_model(args.model, device=args.device)
    result = calibrate(model, tokenizer, squad_text(), args.windows, args.seq_len, args.head_group)
    result.update(model=args.model, text="SQuAD 2.0 dev paragraphs")
    out = Path(args.out) if args.out else REPO_ROOT / "results" / "calibration" / f"rotatekv_{args.model}.pt"
    out = out if out.is_absolute() else REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_save(result, out)  # whole or absent: a run never reads a calibration cut short
    log.info("wrote %s: %d layers x %d channels, head_group=%d, %d tokens (runs read it: method=rotatekv model=%s)",
             out, *result["order_after_rotation"].shape, result["head_group"], result["tokens"], args.model)


if __name__ == "__main__":
    main()
