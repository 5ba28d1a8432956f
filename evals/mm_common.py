"""Plumbing shared by the multimodal tasks (OCRBench, DocVQA, MMAU-Pro): data location, batched
resumable generation through :func:`oscar.multimodal.mm_generate`, per-category tidy rows."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from evals.datafiles import DataUnavailableError
from oscar.lm import KVModel
from oscar.multimodal import MMSample, mm_generate, processor_of, supports
from oscar.paths import DataNotFoundError, locate_data, resolve_data
from oscar.results import NUMBER, PredictionLog

log = logging.getLogger(__name__)

#: what a logged answer holds besides the item's own fields (a record without them is computed again)
ANSWER_FIELDS = dict(prediction=str, input_tokens=int, seconds=NUMBER)



def resolve_dir(path: str | None) -> Path | None:
    """``task.data_dir`` as a folder: absolute as is, relative in the data folders then the repository
    root (oscar.paths); a missing one is where it was looked for first (checks say it is missing)."""
    return None if path is None else locate_data(path)


def require_dir(path: str, task: str) -> Path:
    """``task.data_dir`` resolved, or a DataUnavailableError naming every place looked and `make data`."""
    try:
        return resolve_data(path)
    except DataNotFoundError as e:
        raise DataUnavailableError(f"{task}: task.data_dir: {e}") from None


def hub_dataset_dir(repo_id: str, task: str, allow_patterns: list[str] | None = None) -> Path:
    """A local snapshot of a hub dataset repo (cache first, then the network), or a clear error."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True, allow_patterns=allow_patterns))
    except Exception:  # noqa: BLE001 - not cached: try the network below
        pass
    hint = "download it where the hub is reachable and pass task.data_dir=/local/copy"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise DataUnavailableError(f"{task}: {repo_id} is not in the local cache and HF_HUB_OFFLINE is set; {hint}")
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=allow_patterns, etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - any failure means the data cannot be had here
        raise DataUnavailableError(f"{task}: cannot download {repo_id} from the hub ({type(e).__name__}); {hint}") from None


def check_multimodal(lm: KVModel, task: str, modality: str) -> None:
    """A clear error unless ``lm`` takes ``modality`` ("image" or "audio") input."""
    processor_of(lm)  # text-only models are refused here
    if not supports(lm, modality):
        raise ValueError(f"{task} needs a model that takes {modality} input; {lm.name} does not")


def generate_logged(lm: KVModel, items: list[dict], to_sample: Callable[[dict], MMSample], run_dir: Path,
                    max_new_tokens: int | Callable[[dict], int], batch_size: int = 1, desc: str = "",
                    stop_at_newline: bool = False) -> list[dict]:
    """Answer every item (each has a unique ``key``) and log it to predictions.jsonl at once.

    Items already in the log are not recomputed (a killed run resumes at the batch in flight).
    Batches group items with the same ``max_new_tokens``. Returns the records in item order, each
    the item's JSON fields plus ``prediction``, ``input_tokens`` and ``seconds`` (per batch, shared).
    """
    log_file = PredictionLog(Path(run_dir) / "predictions.jsonl", ANSWER_FIELDS)
    budget = max_new_tokens if callable(max_new_tokens) else (lambda item: max_new_tokens)
    groups: dict[int, list[dict]] = {}
    for item in items:
        if item["key"] not in log_file.done:
            groups.setdefault(budget(item), []).append(item)
    batches = [g[i:i + batch_size] for _, g in sorted(groups.items()) for i in range(0, len(g), batch_size)]
    for batch in tqdm(batches, desc=desc or lm.name, disable=not batches):
        start = time.perf_counter()
        gen = mm_generate(lm, [to_sample(it) for it in batch], budget(batch[0]), stop_at_newline)
        seconds = time.perf_counter() - start
        lengths = gen.inputs["attention_mask"].sum(-1).tolist()
        for item, text, n in zip(batch, gen.texts, lengths):
            record = {k: v for k, v in item.items() if k != "key" and _is_json(v)}
            log_file.write(item["key"], {**record, "prediction": text, "input_tokens": int(n), "seconds": seconds})
    return [log_file.done[it["key"]] for it in items]


def _is_json(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def score_rows(per_subset: dict[str, tuple[float, int]], metric: str) -> list[dict]:
    """Tidy rows ``{subset, metric, value, n}`` from ``{subset: (value, n)}``."""
    return [{"subset": subset, "metric": metric, "value": value, "n": n} for subset, (value, n) in per_subset.items()]
