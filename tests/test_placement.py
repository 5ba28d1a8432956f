"""Models over several devices (oscar/placement.py, ``model.device_map``) on the CPU: a map over "cpu" entries goes
through the same accelerate hooks as a map over GPUs, the offline weight changes of every method on a dispatched
model give the unsplit model's logits, the engine generates the unsplit model's tokens, and maps that cannot hold a
model are refused (with the numbers) before any weight loads. Two real GPUs: tests/test_placement_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar import build_method
from oscar.engine import resolve_mode
from oscar.lm import KVModel
from oscar.models import ModelSpec, build_config, load_model, load_spec, plan_placement
from oscar.placement import Placement, dispatch, model_devices, plan, root_hook

#: every module of a 2-layer registry model on the CPU, one entry per block (as a 2-GPU map would split it)
CPU_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
           "model.rotary_emb": "cpu", "lm_head": "cpu"}
METHODS = {"oscar": {}, "quarot": {}, "rotatekv": dict(reorder=False), "turboquant": {}, "kivi": {}, "ott": {},
           "fp16": {}}
LLAMA_70B = dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=False)


def _spec(name: str, **fields) -> ModelSpec:
    """The registered spec ``name`` with ``fields`` replaced, checked as a spec from a config is."""
    return ModelSpec(**{**vars(load_spec(name)), **fields})


def _diverse(model: torch.nn.Module) -> torch.nn.Module:
    """Weights of std 0.1 (seeded): greedy tokens vary step to step (at 0.02 a tiny model repeats one token)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def split_and_whole():
    """(tiny-llama dispatched by a map over cpu entries, the same weights undispatched, tokenizer)."""
    whole, tokenizer = load_model("tiny-llama", device="cpu")
    split, _ = load_model(_spec("tiny-llama", device_map=CPU_MAP))
    return _diverse(split), _diverse(whole), tokenizer


def test_a_map_dispatches_every_block_through_accelerate_hooks(split_and_whole):
    split, whole, _ = split_and_whole
    assert split.hf_device_map == CPU_MAP
    assert hasattr(split, "_hf_hook") and split._hf_hook.io_same_device  # the root: inputs in, outputs back
    for layer in split.model.layers:
        assert layer._hf_hook.execution_device == "cpu"
    assert not hasattr(whole, "_hf_hook")
    for (name, a), (_, b) in zip(split.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), name  # seeded on the CPU before placement: the same weights
    assert model_devices(split) == [torch.device("cpu")]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_offline_weight_changes_on_a_split_model_give_the_unsplit_logits(name, split_and_whole):
    """prepare_model (V-rotation folding, RotateKV's RoPE and sinks, TurboQuant's signs) on the dispatched model,
    then the same prompt through the method's cache: the logits of every step equal the unsplit model's."""
    split, whole, tokenizer = split_and_whole
    ids = torch.randint(0, 1000, (2, 50), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    logits = []
    for model in (split, whole):
        lm = KVModel(copy.deepcopy(model), tokenizer, build_method(name, residual_length=32, **METHODS[name]),
                     decode="eager")
        cache = lm.new_cache(mask)
        with torch.no_grad():
            out = lm.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           cache=cache, use_cache=True)
            step = lm.model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1),
                            position_ids=mask.sum(-1, keepdim=True), cache=cache, use_cache=True)
        logits.append(torch.cat([out.logits, step.logits], 1))
    assert torch.equal(*logits)


@pytest.mark.parametrize("name", ["oscar", "kivi"])
def test_the_engine_generates_the_unsplit_tokens(name, split_and_whole):
    """Eager decoding over the engine's static (mirror) cache, a left-padded batch across flushes (kivi: the value
    window slides inside the step, reading the per-device lengths)."""
    split, whole, tokenizer = split_and_whole
    prompts = ["The quick brown fox jumps over the lazy dog and keeps on running " * 2, "Hello world, this is"]
    texts = []
    for model in (split, whole):
        lm = KVModel(copy.deepcopy(model), tokenizer, build_method(name, residual_length=32), decode="auto")
        assert lm.engine.mode == "eager"
        texts.append(lm.generate(prompts, 40))
        assert next(iter(lm.engine._slots.values())).cache.token_counts()["keys_packed"] > 0
    assert texts[0] == texts[1]
    assert len(set(texts[0][0].split())) >= 5  # a varied continuation: a wrong cache would not pass by chance


@pytest.mark.parametrize("planner", ["auto", "balanced", "sequential"])
def test_planners_place_every_module_within_max_memory(planner):
    placement = plan_placement(_spec("tiny-qwen3", device_map=planner, max_memory={"cpu": "2GiB"}))
    assert placement.devices == [torch.device("cpu")] and not placement.sharded
    assert placement.weight_bytes == sum(placement.bytes_per_device.values()) > 0
    model, _ = load_model(_spec("tiny-qwen3", device_map=planner, max_memory={"cpu": "2GiB"}), device=placement)
    assert model.hf_device_map == placement.device_map


def test_a_70b_architecture_is_planned_from_its_config_over_two_gpus():
    """No weight is allocated: the plan is made on the meta device (a machine need not have the GPUs to plan)."""
    spec = ModelSpec(name="llama-70b", source="config", config=LLAMA_70B, dtype="bfloat16", device_map="balanced",
                     max_memory={0: "139GiB", 1: "139GiB"})
    placement = plan_placement(spec, check_devices=False)
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # q, o; k, v (8 KV heads); MLP; norms
    params = 80 * layer + 2 * 128256 * 8192 + 8192  # embeddings, lm_head, final norm
    assert placement.weight_bytes == pytest.approx(2 * params, rel=1e-6)  # bf16
    assert placement.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    per_gpu = placement.bytes_per_device
    assert abs(per_gpu["cuda:0"] - per_gpu["cuda:1"]) < 0.05 * placement.weight_bytes  # balanced
    layers = [placement.device_map[f"model.layers.{i}"] for i in range(80)]
    assert layers == sorted(layers) and set(layers) == {0, 1}  # contiguous halves
    assert resolve_mode("auto", placement.devices) == "eager"


def test_max_memory_below_the_weights_is_refused_before_loading(monkeypatch, tmp_path):
    spec = ModelSpec(name="llama-70b", source="config", config=LLAMA_70B, dtype="bfloat16", device_map="auto",
                     max_memory={0: "60GiB", 1: "60GiB"})
    with pytest.raises(ValueError, match=r"max_memory holds 120\.00 GiB in all .*need 131\.4\d GiB in bfloat16"):
        plan_placement(spec, check_devices=False)
    # through run.py: refused before the run folder or the model exists
    from hydra import compose, initialize_config_dir

    import oscar.runner as runner
    from evals import build_task
    from oscar.paths import REPO_ROOT

    monkeypatch.setattr("oscar.lm.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny-llama", "model.device_map=auto", "model.max_memory={cpu:1MiB}",
                                           f"runs_dir={tmp_path}", "logger=files", "task.lengths=[256]"])
    with pytest.raises(ValueError, match=r"max_memory holds 0\.00 GiB .* the weights of tiny-llama need 0\.\d+ GiB"):
        runner.execute(cfg, runner.preflight(cfg, build_task))
    assert not any(tmp_path.iterdir())


def test_maps_that_cannot_hold_the_model_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="offloaded to the CPU or disk"):  # cpu beside a GPU: accelerate would offload
        plan_placement(_spec("tiny-llama", device_map={**CPU_MAP, "model.layers.1": 0}), check_devices=False)
    with pytest.raises(ValueError, match="offloaded to the CPU or disk"):
        plan_placement(_spec("tiny-llama", device_map={**CPU_MAP, "lm_head": "disk"}))
    with pytest.raises(ValueError, match=r"does not place 9 parameter\(s\) of tiny-llama, e\.g\. model\.layers\.1"):
        plan_placement(_spec("tiny-llama", device_map={k: v for k, v in CPU_MAP.items() if k != "model.layers.1"}))
    with pytest.raises(ValueError, match=r"puts 0\.\d+ GiB of tiny-llama's weights on cpu, its model\.max_memory is"):
        plan_placement(_spec("tiny-llama", device_map=CPU_MAP, max_memory={"cpu": "1MiB", 0: "10GiB"}))
    with pytest.raises(ValueError, match=r"this machine has \d+ GPU"):
        plan_placement(_spec("tiny-llama", device_map={"": 7}))
    with pytest.raises(ValueError, match="must be null, one of auto, balanced"):
        plan_placement(_spec("tiny-llama", device_map="everywhere"))
    with pytest.raises(ValueError, match="max_memory is set but model.device_map is null"):
        plan_placement(_spec("tiny-llama", max_memory={0: "1GiB"}))
    with pytest.raises(ValueError, match="is not a size"):
        plan_placement(_spec("tiny-llama", device_map="auto", max_memory={"cpu": "lots"}))
    assert plan_placement(_spec("tiny-llama")) is None


def test_decode_graph_is_refused_for_a_model_over_several_devices():
    assert resolve_mode("auto", [torch.device("cuda", 0), torch.device("cuda", 1)]) == "eager"
    assert resolve_mode("auto", [torch.device("cuda", 0)]) == "graph"
    assert resolve_mode("auto", ["cpu"]) == "eager"
    with pytest.raises(ValueError, match="runs on 2 devices .* a sharded model decodes eagerly"):
        resolve_mode("graph", ["cuda:0", "cuda:1"])


def _per_block_map(empty: torch.nn.Module) -> dict[str, str]:
    """A map with one "cpu" entry per block that must not be split (decoder and vision layers) and per module
    holding weights outside them: the granularity at which a map over GPUs splits a model."""
    blocks = [n for n, m in empty.named_modules() if type(m).__name__ in empty._no_split_modules]
    rest = [n for n, m in empty.named_modules()
            if (next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None)
            and not any(n.startswith(b + ".") for b in blocks)]
    return {n: "cpu" for n in blocks + rest}


@pytest.mark.parametrize("name", [pytest.param("tiny-qwen3-vl", marks=pytest.mark.slow),
                                  pytest.param("tiny-llava", marks=pytest.mark.slow), "tiny-qwen3-omni"])
def test_multimodal_loaders_take_a_device_map(name):
    """The vision-language / omni loaders plan on their skeleton and dispatch; an image prompt through the
    quantized cache gives the unsplit model's answer (Qwen3-VL and LLaVA-NeXT in the slow suite: the same loader
    code as the omni thinker's)."""
    from PIL import Image

    from oscar.models import _SKELETONS
    from oscar.multimodal import MMSample, mm_generate

    assert plan_placement(_spec(name, device_map="balanced")).device_map == {"": "cpu"}  # one device: one entry
    skeleton = _SKELETONS[load_spec(name).kind]
    per_block = _per_block_map(skeleton(load_spec(name), torch.float32, build_config(load_spec(name))))
    assert sum(key.endswith("layers.1") for key in per_block) >= 1  # every decoder layer its own entry
    spec = _spec(name, device_map=per_block)
    placement = plan_placement(spec)
    image = Image.fromarray(torch.randint(0, 255, (96, 128, 3), generator=torch.Generator().manual_seed(0))
                            .to(torch.uint8).numpy())
    answers = []
    for device in (placement, "cpu"):
        model, processor = load_model(name, device="cpu") if device == "cpu" else load_model(spec, device=device)
        assert hasattr(model.get_decoder().layers[1], "_hf_hook") == (device != "cpu")
        lm = KVModel(model, processor, build_method("oscar", residual_length=32), decode="eager")
        answers.append(mm_generate(lm, [MMSample("Describe the picture.", images=[image])], 12).new_tokens)
    assert torch.equal(*answers)


def test_a_submodule_of_a_dispatched_model_gets_its_own_root_hook():
    """Qwen3-Omni's full checkpoint is dispatched as a whole and its thinker used alone: the thinker gets the
    root's hook (inputs to the first device, outputs back), which generate and the engine rely on."""
    whole, _ = load_model("tiny-llama", device="cpu")
    outer = torch.nn.Module()
    outer.inner = copy.deepcopy(whole)
    placement = plan(outer, {f"inner.{k}": v for k, v in CPU_MAP.items()}, None, torch.float32, "outer")
    dispatch(outer, placement)
    inner = outer.inner
    assert not hasattr(inner, "_hf_hook")
    root_hook(inner, placement)
    assert inner._hf_hook.io_same_device and inner._hf_hook.execution_device == "cpu"
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(inner(input_ids=ids).logits, whole(input_ids=ids).logits)
    assert isinstance(placement, Placement)


def test_qwen3_omni_full_checkpoint_loads_its_thinker_with_a_map(tmp_path):
    """A full Qwen3-Omni checkpoint (thinker + disabled talker) loaded with a device map planned on the full model:
    the thinker comes back placed (its map without the "thinker." prefix) with the checkpoint's logits."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from oscar.multimodal import _load

    thinker, _ = load_model("tiny-qwen3-omni", device="cpu")
    full = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(),
                                                                   enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(tmp_path)
    spec = ModelSpec(name="omni-full", source="hub", kind="qwen3_omni", path=str(tmp_path), dtype="float32",
                     device_map={f"thinker.{m}": "cpu" for m in ("audio_tower", "visual", "model", "lm_head")})
    placement = plan_placement(spec)
    assert placement.weight_bytes == sum(p.numel() * 4 for p in thinker.parameters()) + sum(
        b.numel() * 4 for b in thinker.buffers())
    loaded = _load(spec, placement, torch.float32, build_config(spec))
    assert type(loaded) is type(thinker) and loaded.hf_device_map == {m: "cpu" for m in ("audio_tower", "visual",
                                                                                         "model", "lm_head")}
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, thinker(input_ids=ids).logits)
