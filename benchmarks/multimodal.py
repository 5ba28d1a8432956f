"""A multimodal prompt: KV bytes and time per method on a real-size vision(-audio) architecture with random weights.

One real prompt (a DocVQA page at the checkpoint's resolution, Qwen3-VL: up to 16.7M pixels, one token per 32 x 32
pixels; for an omni thinker the 11 s speech clip as well) through each ``--methods`` method: ``kv_bytes`` (the
cache's real stored bytes, PackedTensor.nbytes, every image and audio token included), ``prefill_s`` (a 1-token
generation) and ``decode_s_per_token`` (the extra time per further token), medians of ``--repeats`` runs, and their
ratios against fp16 of the same run. Weights are random (speed and memory do not depend on their values); the
tokenizer is the tiny models' (SmolLM2's plus the multimodal tokens: a vocabulary of 49K instead of 151K). ``--arch``
names an architecture of :data:`ARCHS` or a registry model as it is (``--arch tiny-qwen3-vl`` runs on a CPU).
"""

from __future__ import annotations

import logging
import statistics

import torch

from benchmarks.harness import Run, method_name, peak_gib, reset_peak, wall_seconds

log = logging.getLogger("benchmarks.multimodal")

#: published architecture numbers (config.json of the hub checkpoints)
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
FIELDS = ["arch", "method", "prompt_tokens", "cached_tokens", "kv_bytes", "prefill_s", "decode_s_per_token", "peak_gib",
          "kv_saving_vs_fp16", "decode_speed_vs_fp16"]


def add_arguments(p) -> None:
    from evals.modality import DEFAULT_AUDIO, DEFAULT_IMAGE

    p.add_argument("--arch", default="qwen3-vl-8b", help=f"{', '.join(ARCHS)} or a registry model name")
    p.add_argument("--methods", type=method_name, nargs="+", default=["fp16", "kivi", "oscar"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timings are the median of this many runs")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="a file, or a name in the data folder")
    p.add_argument("--audio", default=DEFAULT_AUDIO, help="a file, or a name in the data folder")


def spec_of(arch: str):
    """The model spec of ``arch``: a random-weight architecture of ARCHS, else a registry model as it is."""
    from oscar.models import ModelSpec, load_spec

    if arch not in ARCHS:
        return load_spec(arch)
    info = ARCHS[arch]
    base = load_spec(info["base"])
    return ModelSpec(**{**base.__dict__, "name": f"{arch}-random", "config": info["config"],
                        "extra": {**base.extra, **info["extra"]}, "dtype": "bfloat16"})


def run(args, bench: Run) -> None:
    from oscar import build_method
    from oscar.lm import load_kv_model
    from oscar.multimodal import MMSample, load_audio, load_image, mm_generate
    from oscar.paths import resolve_data

    spec = spec_of(args.arch)
    images = [load_image(resolve_data(args.image))]
    device = bench.device
    rows = []
    for name in args.methods:
        with torch.device(device):  # random weights made where they live (the same for every method)
            lm = load_kv_model(spec, build_method(name), device=str(device))
        has_audio = getattr(lm.info["processor"], "feature_extractor", None)
        sample = MMSample("What is the page number?", images, [load_audio(resolve_data(args.audio))] if has_audio
                          else [])
        mm_generate(lm, [sample], max_new_tokens=2)  # warm-up
        reset_peak(device)
        timings, generated = {}, {}
        for n in (1, args.new_tokens):
            timings[n] = statistics.median(
                wall_seconds(lambda n=n: generated.update(last=mm_generate(lm, [sample], max_new_tokens=n)), device)
                for _ in range(args.repeats))
        gen = generated["last"]
        rows.append(dict(arch=args.arch, method=name, prompt_tokens=int(gen.inputs["input_ids"].shape[1]),
                         cached_tokens=gen.cache.get_seq_length(), kv_bytes=gen.cache.nbytes, prefill_s=timings[1],
                         decode_s_per_token=(timings[args.new_tokens] - timings[1]) / (args.new_tokens - 1),
                         peak_gib=peak_gib(device)))
        del lm
        reset_peak(device)
    base = next((r for r in rows if r["method"] == "fp16"), rows[0])
    for r in rows:
        r["kv_saving_vs_fp16"] = base["kv_bytes"] / r["kv_bytes"] * r["cached_tokens"] / base["cached_tokens"]
        r["decode_speed_vs_fp16"] = base["decode_s_per_token"] / r["decode_s_per_token"]
        bench.add(r)
        log.info("%s", r)
