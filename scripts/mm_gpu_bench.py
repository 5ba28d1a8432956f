"""Real-size vision/omni architectures with random weights: one real multimodal prompt through each
KV method, KV-cache bytes (PackedTensor.nbytes) and wall time (median of --repeats runs; prefill = a 1-token
generation, decode = the extra time per further token), ratios against fp16 in the same run.

    python scripts/mm_gpu_bench.py --arch qwen3-vl-8b --methods fp16,kivi,oscar --out results/efficiency

Weights are random (speed and memory do not depend on their values); the tokenizer is the tiny
models' (SmolLM2's plus the multimodal tokens, so the vocabulary is 49K instead of 151K). The prompt
is a real DocVQA page at the checkpoint's resolution (Qwen3-VL: up to 16.7M pixels, one token per
32x32 pixels) and, for the omni thinker, the 11 s speech clip as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from oscar.paths import REPO_ROOT  # importable: the package is installed (scripts/ is not)

if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import torch
from tqdm import tqdm

from evals.modality import DEFAULT_AUDIO, DEFAULT_IMAGE
from oscar.paths import resolve_data


# Published architecture numbers (config.json of the hub checkpoints).
ARCHS = {
    "qwen3-vl-8b": dict(base="tiny-qwen3-vl", extra=dict(min_pixels=65536, max_pixels=16777216), config=dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]))),
}


def spec_of(arch: str):
    """The model spec of ``arch``: a random-weight architecture of ARCHS, else a registry model as it is (e.g.
    tiny-qwen3-vl, to check the script on CPU)."""
    from oscar.models import ModelSpec, load_spec

    if arch not in ARCHS:
        return load_spec(arch)
    info = ARCHS[arch]
    base = load_spec(info["base"])
    return ModelSpec(**{**base.__dict__, "name": f"{arch}-random", "config": info["config"],
                        "extra": {**base.extra, **info["extra"]}, "dtype": "bfloat16"})


def main(argv=None) -> None:
    from oscar import build_method
    from oscar.lm import load_kv_model
    from oscar.multimodal import MMSample, load_audio, load_image, mm_generate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3-vl-8b", help=f"{', '.join(ARCHS)} or a registry model name")
    parser.add_argument("--methods", default="fp16,kivi,oscar")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timings are the median of this many runs")
    parser.add_argument("--out", default="results/efficiency")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="a file, or a name in the data folder")
    parser.add_argument("--audio", default=DEFAULT_AUDIO, help="a file, or a name in the data folder")
    args = parser.parse_args(argv)

    spec = spec_of(args.arch)
    images = [load_image(resolve_data(args.image))]
    results = []
    for name in tqdm(args.methods.split(","), desc=f"mm_gpu_bench {args.arch}", unit="method"):
        with torch.device(args.device):  # random weights initialized where they will live (the same for every method)
            lm = load_kv_model(spec, build_method(name), device=args.device)
        audios = [load_audio(resolve_data(args.audio))] if getattr(lm.info["processor"], "feature_extractor", None) else []
        sample = MMSample("What is the page number?", images, audios)
        mm_generate(lm, [sample], max_new_tokens=2)  # warm-up
        timings = {}
        for n in (1, args.new_tokens):
            runs = []
            for _ in range(args.repeats):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                gen = mm_generate(lm, [sample], max_new_tokens=n)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                runs.append(time.perf_counter() - start)
            timings[n] = statistics.median(runs)
        tokens = gen.cache.get_seq_length()
        results.append(dict(arch=args.arch, method=name, prompt_tokens=int(gen.inputs["input_ids"].shape[1]),
                            cached_tokens=tokens, kv_bytes=gen.cache.nbytes,
                            prefill_s=timings[1], decode_s_per_token=(timings[args.new_tokens] - timings[1]) / (args.new_tokens - 1),
                            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None))
        del lm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    base = next((r for r in results if r["method"] == "fp16"), results[0])
    for r in results:
        r["kv_saving_vs_fp16"] = base["kv_bytes"] / r["kv_bytes"] * r["cached_tokens"] / base["cached_tokens"]
        r["decode_speed_vs_fp16"] = base["decode_s_per_token"] / r["decode_s_per_token"]
        sys.stdout.write(json.dumps(r) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mm_{args.arch}.json").write_text(json.dumps(results, indent=2))
    sys.stderr.write(f"mm_gpu_bench: outputs in {out / f'mm_{args.arch}.json'} (one JSON line per method above)\n")


if __name__ == "__main__":
    main()
