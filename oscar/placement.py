"""Placement: a model's modules over several devices (``model.device_map``), through accelerate.

``device_map`` (a model spec field, conf/model/*.yaml) says where the weights go:

- ``null``: one device (the run's ``device``), as without this module;
- ``auto`` / ``balanced`` / ``balanced_low_0`` / ``sequential``: accelerate's planners, within ``max_memory``
  (bytes or sizes per device, ``{0: 70GiB, 1: 70GiB}``; null = what is free now). ``auto`` and ``balanced`` spread
  the decoder layers evenly over the GPUs (leaving each room for its share of the KV cache), ``sequential`` fills
  them in order, ``balanced_low_0`` keeps GPU 0 light;
- ``{module: device}``: an explicit map from module names (prefixes of parameter names, e.g.
  ``model.layers.0``) to a GPU index, ``cuda:N`` or ``cpu``.

:func:`plan` makes the map from the model built with empty weights (the meta device: the config alone, no
weight is read) and refuses, before anything loads, a map that cannot hold the model: ``max_memory`` summing
below the weights, a device given more than its ``max_memory``, modules left over for offloading (``cpu`` beside
GPUs or ``disk``: accelerate would stream those weights in at every forward, and the methods' offline weight
changes would not reach them), a GPU the machine lacks, an explicit map that misses parameters.
:func:`dispatch` then places a model built in memory (random weights) with accelerate's ``dispatch_model``; hub
checkpoints take the resolved map through ``from_pretrained(device_map=...)``, which dispatches the same way.
Each module's weights live on its device; hooks move activations between devices (the root moves the inputs to
the first device and the outputs back).

What follows the weights elsewhere: caches allocate a layer's storage on the device of the key states the layer
sees, offline weight changes happen where each weight lives, kernels launch on their tensors' device and its
current stream. A model whose parameters span devices decodes eagerly (``oscar.engine.resolve_mode``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

#: accelerate's planners (string values of ``device_map``)
PLANNERS = ("auto", "balanced", "balanced_low_0", "sequential")
GiB = 2**30


@dataclass
class Placement:
    """A resolved device map and what it puts where (bytes in the load dtype)."""

    device_map: dict[str, int | str]  # module name -> GPU index or "cpu" (accelerate's spelling)
    weight_bytes: int  # all weights
    bytes_per_device: dict[str, int]  # weights per device, keyed by torch.device string ("cuda:0", "cpu")

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices of the map, in module order (the first holds the inputs)."""
        return list(dict.fromkeys(torch_device(d) for d in self.device_map.values()))

    @property
    def main_device(self) -> torch.device:
        return self.devices[0]

    @property
    def sharded(self) -> bool:
        return len(self.devices) > 1


def torch_device(device: int | str | torch.device) -> torch.device:
    """accelerate's spelling (0, "cpu", "cuda:1") -> torch.device (an int is a CUDA index)."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def accelerate_device(device: int | str | torch.device) -> int | str:
    """torch/accelerate spellings -> accelerate's: a GPU index (int) or "cpu"/"disk"."""
    if isinstance(device, int) or device == "disk":
        return device
    if isinstance(device, str) and device.isdigit():
        return int(device)
    d = torch.device(device)
    if d.type == "cuda":
        return d.index if d.index is not None else 0
    if d.type == "cpu":
        return "cpu"
    raise ValueError(f"model.device_map: unknown device {device!r} (a GPU index, cuda:N, cpu)")


def parse_max_memory(max_memory: dict | None) -> dict[int | str, int] | None:
    """``{0: "70GiB", "cuda:1": 75e9, cpu: "30GB"}`` -> ``{0: bytes, 1: bytes, "cpu": bytes}``."""
    if max_memory is None:
        return None
    from accelerate.utils import convert_file_size_to_int

    parsed = {}
    for device, size in dict(max_memory).items():
        try:
            parsed[accelerate_device(device)] = convert_file_size_to_int(size)
        except ValueError as e:
            raise ValueError(f"model.max_memory: {device}: {size!r} is not a size ({e})") from None
    return parsed


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _owner(name: str, device_map: dict[str, int | str]) -> str | None:
    """The map entry that holds parameter ``name`` (the longest matching module prefix)."""
    best = None
    for key in device_map:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return best


def plan(empty: nn.Module, device_map: str | dict, max_memory: dict | None, dtype: torch.dtype,
         name: str = "the model", check_devices: bool = True) -> Placement:
    """Resolve ``device_map`` for ``empty`` (the model on the meta device) and check that it holds the weights.

    ``check_devices``: refuse GPU indices this machine does not have (off for planning another machine).
    Raises ValueError with the numbers (weights in ``dtype``, per device) when the map cannot hold the model.
    """
    from accelerate.utils import compute_module_sizes, get_balanced_memory, get_max_memory, infer_auto_device_map

    sizes = compute_module_sizes(empty, dtype=dtype)
    total = sizes[""]
    budget = parse_max_memory(max_memory)
    need = f"the weights of {name} need {_gib(total)} in {str(dtype).removeprefix('torch.')} (from its config)"
    if budget is not None:  # the GPUs' budgets (a CPU budget beside them would only be offloading), else the CPU's
        usable = {d: b for d, b in budget.items() if isinstance(d, int)} or {d: b for d, b in budget.items()
                                                                             if d == "cpu"}
        if sum(usable.values()) < total:
            raise ValueError(f"model.max_memory holds {_gib(sum(usable.values()))} in all "
                             f"({', '.join(f'{d}: {_gib(b)}' for d, b in usable.items())}); {need}")
    no_split = list(getattr(empty, "_no_split_modules", None) or [])
    if isinstance(device_map, str):
        if device_map not in PLANNERS:
            raise ValueError(f"model.device_map must be null, one of {', '.join(PLANNERS)}, or a map "
                             f"{{module: device}}; got {device_map!r}")
        memory = get_max_memory(budget)
        if device_map != "sequential":
            memory = get_balanced_memory(empty, max_memory=memory, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")
        resolved = infer_auto_device_map(empty, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    elif isinstance(device_map, dict) and device_map:
        resolved = {str(module): accelerate_device(device) for module, device in device_map.items()}
        names = [n for n, _ in empty.named_parameters()] + [n for n, _ in empty.named_buffers()]
        missing = [n for n in names if _owner(n, resolved) is None]
        if missing:
            raise ValueError(f"model.device_map does not place {len(missing)} parameter(s) of {name}, e.g. "
                             f"{', '.join(missing[:3])}: give every module a device (\"\" = the whole model)")
    else:
        raise ValueError(f"model.device_map must be null, one of {', '.join(PLANNERS)}, or a non-empty map "
                         f"{{module: device}}; got {device_map!r}")

    per_device: dict[str, int] = {}
    for module, device in resolved.items():
        key = "disk" if device == "disk" else str(torch_device(device))
        per_device[key] = per_device.get(key, 0) + sizes.get(module, 0)
    gpus = {d for d in resolved.values() if isinstance(d, int)}
    offloaded = sorted({m for m, d in resolved.items() if d == "disk" or (d == "cpu" and gpus)})
    if offloaded:
        left = sum(sizes.get(m, 0) for m in offloaded)
        where = (f"max_memory {', '.join(f'{d}: {_gib(b)}' for d, b in budget.items())}" if budget is not None
                 else "the memory free now")
        raise ValueError(f"model.device_map={device_map!r} does not fit {name} on the GPUs ({where}); {need} and "
                         f"{_gib(left)} of it ({', '.join(offloaded[:3])}{', ...' if len(offloaded) > 3 else ''}) "
                         f"would be offloaded to the CPU or disk, which this project does not do (weights streamed in "
                         f"at every forward; the methods' offline weight changes would not reach them): give "
                         f"max_memory that holds the weights, or more GPUs")
    if check_devices and gpus:
        available = torch.cuda.device_count()
        absent = sorted(g for g in gpus if g >= available)
        if absent:
            raise ValueError(f"model.device_map puts {name} on GPU(s) {absent}, this machine has {available} GPU(s)")
    if budget is not None and not isinstance(device_map, str):
        for device, used in per_device.items():
            limit = budget.get(accelerate_device(device))
            if limit is not None and used > limit:
                raise ValueError(f"model.device_map puts {_gib(used)} of {name}'s weights on {device}, its "
                                 f"model.max_memory is {_gib(limit)}")
    placement = Placement(resolved, total, per_device)
    log.info("%s over %s: %s", name, ", ".join(str(d) for d in placement.devices),
             ", ".join(f"{d} {_gib(b)}" for d, b in per_device.items()))
    return placement


def empty_model(build) -> nn.Module:
    """``build()`` (a model constructor) on the meta device: the module tree and shapes, no memory."""
    with torch.device("meta"):
        return build()


def dispatch(model: nn.Module, placement: Placement) -> nn.Module:
    """Put ``model``'s modules on the devices of ``placement`` with accelerate's hooks (also when every entry
    names one device: the hooks are what a split model runs through)."""
    from accelerate import dispatch_model

    main = next(iter(placement.device_map.values()))  # accelerate's spelling ("cpu" must be the string)
    quiet = logging.getLogger("accelerate.big_modeling")  # warns of offloading for any "cpu" entry: none is offloaded
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model = dispatch_model(model, placement.device_map, main_device=main, force_hooks=True,
                               skip_keys=getattr(model, "_skip_keys_device_placement", None))
    finally:
        quiet.setLevel(level)
    model.hf_device_map = dict(placement.device_map)
    return model


def root_hook(model: nn.Module, placement: Placement) -> None:
    """Give ``model`` (a submodule of a dispatched model, e.g. Qwen3-Omni's thinker) the root's hook: inputs to
    the first device, outputs back to the inputs' device (generate and the decode engine read the logits there)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(model, AlignDevicesHook(execution_device=next(iter(placement.device_map.values())),
                                               io_same_device=True,
                                               skip_keys=getattr(model, "_skip_keys_device_placement", None)),
                       append=True)


def model_devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices of ``model``'s parameters (in module order)."""
    return list(dict.fromkeys(p.device for p in model.parameters()))


def layer_devices(model: nn.Module) -> list[torch.device]:
    """The device of every decoder layer's attention, by layer index: where that layer's cache lives."""
    from oscar.weights import attention_modules

    found = {m.layer_idx: m.v_proj.weight.device for m in attention_modules(model)}
    return [found[i] for i in sorted(found)]
