"""lm-eval model ``kvq``: any lm-eval task on any of our KV methods, through the quantized cache.

    python -m evals.lm_eval_model --model kvq \
        --model_args model=smollm2-135m,method=oscar,k_bits=2,group_size=32,residual_length=128 \
        --tasks gsm8k --limit 20                      # lm-eval's own CLI, with ``kvq`` registered
    python run.py task=lm_eval task.tasks=[gsm8k] method=kivi    # the same through our Hydra runner

``--model_args``: ``model`` (a registered name or hub id), ``method`` and the method's
hyperparameters, ``backend``, ``seed``, ``quantize_prefill``, ``dtype``, ``max_length``; ``--device`` (default: the
best available, CUDA if visible, else the CPU; lm-eval's own default is cuda:0), ``--batch_size``.

Before any weights load, both entry points check what the run reads (:meth:`LMEvalTasks.check`): every task name is
known to lm-eval, and the tasks' datasets can be had. Where the Hugging Face hub answers (one request, 5 s at most),
the run downloads them; where it does not (or ``HF_HUB_OFFLINE`` is set), they must load from the local cache, and
the process reads them offline from then on (no connection retries during the run); otherwise one line says which
tasks' data is missing and how to get it.

Generation tasks (``generate_until``) prefill in full precision and decode on the quantized cache,
as in KIVI / OScaR. Loglikelihood tasks (multiple choice, ``loglikelihood_rolling`` perplexity) have
no decoding phase: every score comes from one forward pass over the prompt, so they only feel the
quantization with ``quantize_prefill=true`` (prefill attention on the quantized K/V).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from evals.base import Task, TaskResult, register_task
from evals.datafiles import DataUnavailableError
from oscar.atomic import write_json
from oscar.cache import cache_argument
from oscar.lm import KVModel, load_kv_model
from oscar.method import build_method
from oscar.models import default_device
from oscar.options import bounded
from oscar.provenance import process_code_version

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # lm-eval is the `eval` extra: the module stays importable without it
    LM = object

    def register_model(*names):
        return lambda cls: cls

log = logging.getLogger(__name__)


@register_model("kvq")
class KVQuantLM(LM):
    """lm-eval's LM interface over a :class:`KVModel` (built from names, or passed in as ``lm``)."""

    def __init__(self, model: str = "smollm2-135m", method: str = "oscar", lm: KVModel | None = None,
                 quantize_prefill: bool = False, batch_size: int | str = 1, device: str | None = None,
                 dtype: str | None = None, max_length: int | None = None, backend: str = "torch", seed: int = 0,
                 max_batch_size=None, **hyperparameters):
        super().__init__()
        if lm is None:
            check_device(device)
            lm = load_kv_model(model, build_method(method, **hyperparameters), backend, seed=int(seed), device=device,
                               dtype=dtype, max_length=int(max_length) if max_length else None)
        self.kv = lm
        self.quantize_prefill = bool(quantize_prefill)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)

    # ------------------------------------------------------------------ helpers

    @property
    def tokenizer(self):
        return self.kv.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def _prefix_id(self) -> int:
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    @torch.no_grad()
    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether greedy decoding reproduces it."""
        ids = (context + continuation)[-(self.kv.max_length + 1):]
        inputs = torch.tensor([ids[:-1]], device=self.kv.device)
        cache = self.kv.new_cache(torch.ones_like(inputs), quantize_prefill=self.quantize_prefill)
        logits = self.kv.model(input_ids=inputs, **cache_argument(self.kv.model, cache)).logits[0, -len(continuation):]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation, device=logprobs.device)
        total = logprobs.gather(1, target[:, None]).sum().item()
        return total, bool((logprobs.argmax(-1) == target).all())

    # ------------------------------------------------------------------ lm-eval's interface

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="loglikelihood"):
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())           # lm-eval: trailing spaces go right
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            context_ids = self._encode(context) if context else [self._prefix_id]
            out.append(self._continuation_logprob(context_ids, self._encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
            windows = get_rolling_token_windows(self._encode(request.args[0]), self._prefix_id,
                                                self.kv.max_length, context_len=1)
            out.append(sum(self._continuation_logprob(*make_disjoint_window(w))[0] for w in windows))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first ``until`` string; batches share generation kwargs."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            if kwargs.get("do_sample"):
                log.warning("kvq decodes greedily; do_sample=%s is ignored", kwargs["do_sample"])
            until = kwargs.get("until") or [self.tokenizer.eos_token]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                prompts = [self._fit(requests[i].args[0], max_new) for i in batch]
                for i, text in zip(batch, self.kv.generate(prompts, max_new)):
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    results[i] = text
                bar.update(len(batch))
        bar.close()
        return results

    def _fit(self, context: str, max_new: int) -> str:
        """The context left-truncated so that context + generation fit the model's max_length."""
        ids = self._encode(context)
        room = self.kv.max_length - max_new
        return context if len(ids) <= room else self.tokenizer.decode(ids[-room:])


def cache_code_versions(run_dir: Path) -> list[str]:
    """Every version of the code that has answered into the run's lm-eval request cache (``lm_eval_cache*``, which a
    resumed run reads its earlier answers from), this one last, as a record's ``code_version`` list
    (oscar.results.record_code_versions); kept in ``lm_eval_cache_versions.json`` beside the cache. A cache without
    that file (written before versions were kept), or a file that is not a list of versions, counts "unrecorded"."""
    path = run_dir / "lm_eval_cache_versions.json"
    try:
        versions = json.loads(path.read_text()) if path.exists() else []
    except json.JSONDecodeError:
        versions = None
    if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
        versions = ["unrecorded"]
    elif not versions and any(f != path for f in run_dir.glob("lm_eval_cache*")):
        versions = ["unrecorded"]
    current = process_code_version() or "unrecorded"  # as oscar.results.PredictionLog stamps its records
    versions = [v for v in versions if v != current] + [current]
    write_json(path, versions)
    return versions


@register_task("lm_eval")
@dataclass
class LMEvalTasks(Task):
    """Any lm-eval tasks on the run's model + method (``python run.py task=lm_eval task.tasks=[...]``).

    Options mirror lm-eval's: ``tasks``, ``limit``, ``num_fewshot``, ``include_path`` (folders of
    task YAMLs, e.g. local datasets), ``apply_chat_template``, ``batch_size``, ``quantize_prefill``.
    lm-eval's request cache (sqlite in the run folder) makes a killed run resume per request.
    """

    tasks: list[str] = field(default_factory=lambda: ["gsm8k"])
    limit: float | None = bounded(None, gt=0)  # an int count, or a fraction < 1
    num_fewshot: int | None = bounded(None, ge=0)
    include_path: list[str] = field(default_factory=list)
    apply_chat_template: bool = False
    batch_size: int = bounded(1, ge=1)
    quantize_prefill: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tasks:
            raise ValueError("lm_eval: tasks must name at least one lm-eval task")
        if self.limit is not None and self.limit >= 1 and self.limit != int(self.limit):
            raise ValueError(f"lm_eval: limit must be a whole number of samples or a fraction < 1, got {self.limit}")
        self._manager = None

    def check(self) -> None:
        """lm-eval installed, include_path folders present, every task name known to lm-eval, and the tasks'
        datasets reachable on the hub or loadable from the local cache (see the module docstring)."""
        try:
            import lm_eval.tasks  # noqa: F401
        except ImportError as e:
            raise ImportError("task lm_eval needs lm-eval: pip install 'oscar-kv[eval]'") from e
        missing = [p for p in self.include_path if not Path(p).exists()]
        if missing:
            raise FileNotFoundError(f"lm_eval: include_path {missing} not found")
        self._manager = _task_manager(tuple(str(p) for p in self.include_path))
        unknown = [t for t in self.tasks if t not in self._manager.all_tasks]
        if unknown:
            raise ValueError(f"lm_eval: unknown lm-eval task(s) {unknown} (`lm_eval ls tasks` lists them; local "
                             f"task YAMLs go in task.include_path)")
        check_datasets(self._manager, list(self.tasks))

    def data_files(self) -> list[Path]:
        """Every file under the ``include_path`` folders (local task YAMLs and the data they name); hub datasets
        are not local files."""
        return [f for folder in map(Path, self.include_path) for f in sorted(folder.rglob("*")) if f.is_file()]

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        import lm_eval

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        versions = cache_code_versions(run_dir)
        adapter = KVQuantLM(lm=lm, quantize_prefill=self.quantize_prefill, batch_size=self.batch_size)
        manager = self._manager or _task_manager(tuple(str(p) for p in self.include_path))
        results = lm_eval.simple_evaluate(model=adapter, tasks=list(self.tasks), limit=self.limit,
                                          num_fewshot=self.num_fewshot, task_manager=manager,
                                          apply_chat_template=self.apply_chat_template,
                                          use_cache=str(run_dir / "lm_eval_cache"), log_samples=True)
        with (run_dir / "predictions.jsonl").open("w") as f:
            for task, samples in sorted(results.get("samples", {}).items()):
                for s in samples:
                    f.write(json.dumps({"key": f"{task}/{s.get('doc_id')}", "task": task, "doc_id": s.get("doc_id"),
                                        "target": s.get("target"), "response": s.get("filtered_resps"),
                                        "code_version": versions},
                                       default=str) + "\n")
        rows, metrics = [], {}
        for task, values in sorted(results["results"].items()):
            n = results.get("n-samples", {}).get(task, {}).get("effective")
            for key, value in sorted(values.items()):
                name, comma, filt = key.partition(",")        # metrics are "<metric>,<filter>"
                if not comma or not isinstance(value, (int, float)) or name.endswith("_stderr"):
                    continue
                metric = name if filt in ("", "none") else f"{name}/{filt}"
                rows.append({"subset": task, "metric": metric, "value": float(value), "n": n})
                metrics[f"{task}/{metric}"] = float(value)
        # lm-eval commits its request cache after a whole generate_until call, never part of one: a resumed run
        # generated either every sample in this process (the counters are the run's) or none (no figure)
        stored = (lm.stored_bytes, lm.stored_tokens) if lm.stored_tokens else None
        return TaskResult(metrics=metrics, rows=rows, stored=stored)


@functools.cache
def _task_manager(include_path: tuple[str, ...]):
    """lm-eval's task index (a few seconds to build: once per process and include_path)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None)


def _offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off")


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (``HF_HUB_OFFLINE`` set, or one request to its endpoint
    failing within 5 s), None when it answers (any HTTP status counts as an answer)."""
    if _offline_requested():
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception as e:  # noqa: BLE001 - any failure to get an answer means the hub cannot be used
        return f"{constants.ENDPOINT} does not answer: {type(e).__name__}"
    return None


def read_hub_offline() -> None:
    """From now on, this process reads hub datasets and files from the local cache only (what ``HF_HUB_OFFLINE=1``
    at start-up does: no request, no connection retries). ``datasets`` and ``huggingface_hub`` read the variable
    once, when they are imported, so their flags are set too."""
    import datasets
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def check_datasets(manager, tasks: list[str]) -> None:
    """Where the hub does not answer, every task's dataset must load from the local cache (the run then reads it
    offline); else a DataUnavailableError naming the tasks and how to get their data. Where it answers: nothing to
    check here (the run downloads what it needs)."""
    reason = hub_unreachable()
    if reason is None:
        return
    read_hub_offline()
    missing = {}
    for name in tasks:
        try:
            manager.load([name])  # builds the task: its dataset loads from the cache, or fails at once offline
        except ConnectionError:  # datasets' "Couldn't reach ... (OfflineModeIsEnabled)": not in the cache
            missing[name] = ""
        except Exception as e:  # noqa: BLE001 - lm-eval and datasets raise many kinds; each means "not here"
            missing[name] = f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if missing:
        raise DataUnavailableError(
            f"lm_eval: the data of {', '.join(name + why for name, why in missing.items())} is not in the local cache "
            f"and the Hugging Face hub cannot be used ({reason}); run once where the hub is reachable (the datasets "
            f"stay in the cache, HF_HOME), or give local task YAMLs with task.include_path (--include_path)")


def check_device(device: str | None) -> None:
    """A ValueError for a device this machine does not have (``cuda`` without a visible GPU)."""
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"kvq: --device {device} but no CUDA GPU is visible here (leave --device out for the best "
                         f"available device: {default_device()})")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's CLI with ``kvq`` registered (``python -m evals.lm_eval_model --model kvq ...``). ``--device``
    defaults to the best available device; the device and the tasks' data are checked before lm-eval loads the
    model (one line and exit code 2 for what cannot run here)."""
    from oscar.runner import BAD_INPUT

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=False)
    for option in ("--model", "--tasks", "--include_path", "--device"):
        parser.add_argument(option)
    known, _ = parser.parse_known_args(argv)
    try:
        if known.device is None:
            argv += ["--device", default_device()]
        check_device(known.device)
        if known.model == "kvq" and known.tasks:
            task = LMEvalTasks(tasks=known.tasks.split(","),
                               include_path=[known.include_path] if known.include_path else [])
            task.check()
    except BAD_INPUT as e:
        sys.stderr.write(f"bad input, nothing was loaded: {e}\n")
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
