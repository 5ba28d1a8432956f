"""Models beyond one GPU: a 30B MoE omni model and a 70B dense model split over GPUs, BF16 vs OScaR through the engine.

    python -m benchmarks multi_gpu [--models qwen3-omni-30b-a3b llama-3.1-70b] [--contexts 32768 131072]
    python -m benchmarks multi_gpu --dry-run [--gpus 2 --gpu-memory 139]   # a CPU is enough

Architectures (random bf16 weights; decode speed does not depend on their values), from the checkpoints' configs: the
thinker of Qwen/Qwen3-Omni-30B-A3B-Instruct (48 MoE layers, 128 experts / 8 active, 32 query / 4 KV heads, head_dim
128, interleaved M-RoPE; its audio and vision encoders are built too, so the GPUs hold what the real thinker holds)
and meta-llama/Llama-3.1-70B (80 layers, 64 query / 8 KV heads, head_dim 128). Each is planned by ``oscar.placement``
(``device_map=balanced`` over every visible GPU: decoder layers split evenly, each GPU keeping room for its share of
the KV cache; accelerate's planner) and its weights are made directly on their GPUs (the model built on the meta
device, each parameter allocated on its planned GPU, transformers' own initialization, then accelerate's hooks).

Per model and context, through ``DecodeEngine.decode`` (what generate runs after the prefill; benchmarks.filled),
eagerly: a model split over GPUs decodes eagerly (the engine refuses CUDA graphs for it, oscar/engine.py). The cache
of each cell is written directly with random contents as a prefill would leave it (a 128K prefill through a 70B model
would take minutes per cell). Cells: ``batch1`` (fp16 on the static BF16 cache, OScaR on the CuPy kernels),
``max_batch`` (each one's largest batch, found by allocating and running steps), ``bf16_max_batch`` (OScaR at BF16's
largest batch). Columns: ms_per_token (wall clock of the engine's loop), tokens_per_s, kv_bytes (the cache's real
stored bytes, all GPUs), kv_bytes_predicted (the same from the method's quantizers on one group of tokens, a check),
allocated_bytes, peak_gib (the fullest GPU), gpus, layers_per_gpu, weights_gib_per_gpu. kv_bytes is read after the
timed steps (a few dozen tokens past the context), kv_bytes_predicted at the context. Written to multi_gpu.csv after
every cell; ``--budget`` (seconds) skips the cells that would start after it (a run cut short keeps what it measured).

``--dry-run`` needs no GPU: per architecture the plan over ``--gpus`` GPUs of ``--gpu-memory`` GiB (weights per GPU
from the config, KV bytes per sequence, the predicted largest batches), then the whole measurement loop on the
registry's tiny-llama placed by the same planner on the CPU (fp16 and OScaR on the torch backend's mirror, batches 1
and 2): multi_gpu_plan.csv and multi_gpu_dry_run.csv in ``--out`` (default runs/benchmarks/multi_gpu_dry_run): never
multi_gpu.csv.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.filled import HEADROOM, decode_cell, largest_batch
from benchmarks.harness import Run, bench_method
from oscar.placement import GiB, Placement, dispatch, empty_model, layer_devices, plan, torch_device

log = logging.getLogger("benchmarks.multi_gpu")

#: the architectures of the hub checkpoints (RoPE scaling left out: it changes no shape and no cost)
ARCHITECTURES = {
    "qwen3-omni-30b-a3b": dict(
        model_type="qwen3_omni_moe_thinker", tie_word_embeddings=False,
        text_config=dict(vocab_size=152064, hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                         norm_topk_prob=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        audio_config=dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                          d_model=1280, output_dim=2048, downsample_hidden_size=480),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                           deepstack_visual_indexes=[8, 16, 24])),
    "llama-3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=262144, rope_theta=500000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
}
#: (method, backend) of the measured configurations; the dry run on a CPU runs OScaR on the mirror instead
CONFIGS = {"fp16": ("fp16", "torch"), "oscar": ("oscar", "cupy")}
DRY_CONFIGS = {"fp16": ("fp16", "torch"), "oscar": ("oscar", "torch")}
DRY_RUN_OUT = Path("runs/benchmarks/multi_gpu_dry_run")
FIELDS = ["model", "context", "cell", "method", "backend", "decode", "batch", "ms_per_token", "tokens_per_s",
          "kv_bytes", "kv_bytes_predicted", "allocated_bytes", "peak_gib", "gpus", "layers_per_gpu",
          "weights_gib_per_gpu"]


def new_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``config`` (Qwen3-Omni: its thinker), weights as the current device context makes them."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    if config.model_type == "qwen3_omni_moe_thinker":
        return Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def config_of(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def skeleton(config, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    return empty_model(lambda: new_model(config, dtype))


def place(empty: torch.nn.Module, gpus: int, gpu_memory_gib: float | None, dtype: torch.dtype = torch.bfloat16,
          name: str = "model", check_devices: bool = True) -> Placement:
    """``device_map=balanced`` over ``gpus`` GPUs (each ``gpu_memory_gib``, None = what is free now)."""
    memory = None if gpu_memory_gib is None else {i: int(gpu_memory_gib * GiB) for i in range(gpus)}
    return plan(empty, "balanced", memory, dtype, name, check_devices)


def build(config, placement: Placement, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """Random weights made on their planned devices (never the whole model on one), then accelerate's hooks."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE tables) computed
        model = new_model(config, dtype)
    for module_name, device in placement.device_map.items():
        module = model.get_submodule(module_name)
        for name, param in list(module.named_parameters()):
            target = torch_device(device)
            set_module_tensor_to_device(module, name, target, value=torch.empty(param.shape, dtype=dtype,
                                                                                device=target))
    model.tie_weights()
    for item in [*model.modules(), *model.parameters()]:  # made on meta: initialize them now, on their devices
        item.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.initialize_weights()
    return dispatch(model, placement).eval().requires_grad_(False)


def kv_bytes_per_sequence(config, method_name: str, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Stored bytes of one sequence's cache at ``context`` tokens, from the method's own quantizers on one group of
    tokens (packed part) plus the full-precision residual window, as the engine's cache holds it after a prefill."""
    text = config.get_text_config()
    method = bench_method(method_name)
    heads, dim, layers = text.num_key_value_heads, text.head_dim, text.num_hidden_layers
    g, r = method.group_size, method.residual_length
    x = torch.randn(1, heads, g, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    per_token = (method.quantize_keys(x, 0).nbytes + method.quantize_values(x, 0).nbytes) / g
    residual = context % r if r and method.k_bits < 16 else 0
    full = 2 * heads * dim * torch.empty((), dtype=dtype).element_size()
    return int(layers * ((context - residual) * per_token + residual * full))


def predicted_batch(placement: Placement, per_sequence: int, gpu_memory_gib: float, layers: list) -> int:
    """The batch the GPU that fills first allows: its free memory (after its weights and HEADROOM) over its layers'
    share of a sequence's cache (the estimate ``largest_batch`` starts its search from)."""
    fits = []
    for device in placement.devices:
        share = sum(1 for d in layers if d == device) / len(layers)
        if share:  # a GPU without decoder layers holds no cache
            free = gpu_memory_gib * GiB - placement.bytes_per_device[str(device)] - HEADROOM
            fits.append(int(free // (per_sequence * share)))
    return max(0, min(fits))


def layer_plan(empty: torch.nn.Module, placement: Placement) -> list[torch.device]:
    """The planned device of every decoder layer's attention (by layer index), read off the map of ``empty``."""
    from oscar.weights import attention_modules

    names = {id(m): n for n, m in empty.named_modules()}
    found = {}
    for module in attention_modules(empty):
        name = names[id(module)]
        key = max((k for k in placement.device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        found[module.layer_idx] = torch_device(placement.device_map[key])
    return [found[i] for i in sorted(found)]


def dry_plans(args, bench: Run) -> None:
    """The plan per architecture over args.gpus GPUs of args.gpu_memory GiB (weights, KV bytes, predicted batches):
    rows of the multi_gpu_plan table."""
    for name in tqdm(args.models, desc="plans", unit="model"):
        config = config_of(ARCHITECTURES[name])
        empty = skeleton(config)
        placement = place(empty, args.gpus, args.gpu_memory, name=name, check_devices=False)
        layers = layer_plan(empty, placement)
        for context in args.contexts:
            row = dict(model=name, context=context, gpus=args.gpus, weights_gib=placement.weight_bytes / GiB,
                       weights_gib_per_gpu=_per_gpu(placement), layers_per_gpu=_layers_per_gpu(layers))
            for method in CONFIGS:
                per_sequence = kv_bytes_per_sequence(config, method, context)
                row[f"{method}_kv_gib_per_sequence"] = per_sequence / GiB
                row[f"{method}_predicted_max_batch"] = predicted_batch(placement, per_sequence, args.gpu_memory,
                                                                       layers)
            bench.add(row, table="multi_gpu_plan")
            log.info("%-20s T=%-6d weights %.1f GiB (%s per GPU, layers %s) | KV per sequence fp16 %.2f GiB, "
                     "oscar %.2f GiB (%.2fx) | predicted largest batch fp16 %d, oscar %d", name, context,
                     row["weights_gib"], row["weights_gib_per_gpu"], row["layers_per_gpu"],
                     row["fp16_kv_gib_per_sequence"], row["oscar_kv_gib_per_sequence"],
                     row["fp16_kv_gib_per_sequence"] / row["oscar_kv_gib_per_sequence"],
                     row["fp16_predicted_max_batch"], row["oscar_predicted_max_batch"])


def _per_gpu(placement: Placement) -> str:
    return "/".join(f"{b / GiB:.1f}" for b in placement.bytes_per_device.values())


def _layers_per_gpu(layers: list) -> str:
    return "/".join(str(sum(1 for d in layers if d == device)) for device in dict.fromkeys(layers))


def measure(model, name: str, config, placement: Placement, contexts: list[int], steps: int, configs: dict,
            search: bool, bench: Run, table: str | None = None) -> None:
    """Every cell of one model (see the module docstring), added to ``bench``'s ``table``."""
    layers = layer_devices(model)
    dtype = next(model.parameters()).dtype
    common = dict(gpus=len(placement.devices), layers_per_gpu=_layers_per_gpu(layers),
                  weights_gib_per_gpu=_per_gpu(placement))

    def add(row: dict | None, context: int, kind: str) -> None:
        if row is None:
            log.info("%s T=%d %s: does not fit", name, context, kind)
            return
        method = next(m for m, (method_name, backend) in configs.items()
                      if (method_name, backend) == (row["method"], row["backend"]))
        predicted = kv_bytes_per_sequence(config, method, context, dtype) * row["batch"]
        bench.add(dict(model=name, context=context, cell=kind, **row, kv_bytes_predicted=predicted, **common), table)
        log.info("%-20s T=%-6d %-15s %-5s/%-5s B=%-4d %8.2f ms/token %9.1f tok/s  KV %.2f GiB (predicted %.2f)  "
                 "peak %.1f GiB", name, context, kind, row["method"], row["backend"], row["batch"],
                 row["ms_per_token"], row["tokens_per_s"], row["kv_bytes"] / GiB, predicted / GiB, row["peak_gib"])

    fp16, oscar = configs["fp16"], configs["oscar"]
    for context in contexts:
        if not bench.budget.allows(f"{name} T={context}"):
            continue
        ones = {key: decode_cell(model, *key, "eager", 1, context, steps) for key in (fp16, oscar)}
        for key in (fp16, oscar):
            add(ones[key], context, "batch1")
        if None in ones.values():
            continue
        if search:
            top = largest_batch(model, *fp16, context, steps, mode="eager")
        else:
            top = decode_cell(model, *fp16, "eager", 2, context, steps)
        add(top, context, "max_batch")
        add(decode_cell(model, *oscar, "eager", top["batch"], context, steps), context, "bf16_max_batch")
        if not bench.budget.allows(f"OScaR's largest batch of {name} T={context}"):
            continue
        if search:
            add(largest_batch(model, *oscar, context, steps, mode="eager"), context, "max_batch")
        else:
            add(decode_cell(model, *oscar, "eager", 2, context, steps), context, "max_batch")


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    p.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dry-run", action="store_true", help="plans only, and the loop on a tiny model on the CPU")
    p.add_argument("--gpus", type=int, default=2, help="dry run: GPUs to plan for")
    p.add_argument("--gpu-memory", type=float, default=139.0, help="dry run: GiB per GPU")
    p.set_defaults(budget=480.0)


def run(args, bench: Run) -> None:
    if args.dry_run:  # its own tables in its own folder: a dry run never touches multi_gpu.csv
        from oscar.models import build_config, load_spec

        bench.out = args.out or DRY_RUN_OUT
        dry_plans(args, bench)
        config = build_config(load_spec("tiny-llama"))
        placement = plan(skeleton(config, torch.float32), "balanced", {"cpu": "4GiB"}, torch.float32, "tiny-llama")
        model = build(config, placement, torch.float32)
        measure(model, "tiny-llama", config, placement, [300], 4, DRY_CONFIGS, False, bench, "multi_gpu_dry_run")
        return
    bench.require_gpu()
    if torch.cuda.device_count() < 2:
        log.warning("%d GPU(s) visible: the models are placed on what there is", torch.cuda.device_count())
    for name in tqdm(args.models, desc="multi_gpu", unit="model"):
        config = config_of(ARCHITECTURES[name])
        placement = place(skeleton(config), torch.cuda.device_count(), None, name=name)
        model = build(config, placement)
        log.info("%s: built on %s", name, ", ".join(map(str, placement.devices)))
        measure(model, name, config, placement, args.contexts, args.steps, CONFIGS, True, bench)
        del model
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    """Per (model, context) OScaR against fp16 (KV memory, time per token at batch 1 and at fp16's largest batch,
    throughput each at its largest), then every row."""
    from benchmarks.report import context as ctx
    from benchmarks.report import num, ratio
    from evals.tables import markdown

    cells = {(r["model"], r["context"], r["cell"], r["method"]): r for r in rows}
    summary = []
    for model, context in dict.fromkeys((r["model"], r["context"]) for r in rows):
        f1, o1, ftop, osame, otop = (cells.get((model, context, cell, method)) for cell, method in (
            ("batch1", "fp16"), ("batch1", "oscar"), ("max_batch", "fp16"), ("bf16_max_batch", "oscar"),
            ("max_batch", "oscar")))

        def over(a, b, key="ms_per_token"):
            return ratio(a[key] / b[key]) if a and b and isinstance(a[key], (int, float)) and b[key] else "–"

        first = next(r for r in rows if (r["model"], r["context"]) == (model, context))
        summary.append([model, ctx(context), first["gpus"], first["layers_per_gpu"], first["weights_gib_per_gpu"],
                        over(f1, o1, "kv_bytes"), over(f1, o1), over(ftop, osame) + (f" (B={ftop['batch']})" if ftop
                                                                                     else ""),
                        over(otop, ftop, "tokens_per_s") + (f" ({otop['batch']} vs {ftop['batch']})" if otop and ftop
                                                            else "")])
    body = [[r["model"], ctx(r["context"]), r["cell"], f"{r['method']} ({r['backend']})", r["batch"],
             num(r["ms_per_token"]), num(r["tokens_per_s"], 1), num((r.get("kv_bytes") or math.nan) / GiB),
             num(r["kv_bytes_predicted"] / GiB), num(r.get("peak_gib"), 1)] for r in rows]
    return (markdown(["model", "context", "GPUs", "layers per GPU", "weights GiB per GPU", "KV memory fp16 / OScaR",
                      "OScaR vs fp16, B=1", "at BF16's largest batch", "throughput, each at its largest"], summary)
            + "\n\nSplit over the GPUs by accelerate (device_map=balanced), decoded eagerly (a model over several GPUs "
            "is not captured as one CUDA graph); ratios of ms/token and tokens/s.\n\n"
            + markdown(["model", "context", "cell", "configuration", "batch", "ms/token", "tok/s", "KV GiB",
                        "KV GiB predicted", "peak GiB (fullest GPU)"], body))
