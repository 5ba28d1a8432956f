"""Perplexity on WikiText-2 (test) with the quantized cache in the loop.

Protocol (the GPTQ / QuaRot / KIVI fake-quant evaluation):
  1. the test split's rows joined with "\\n\\n" and tokenized once, with the tokenizer's defaults (a BOS,
     if the tokenizer adds one, starts the corpus only; windows get none);
  2. cut into non-overlapping windows of ``window`` tokens (the last partial window is dropped);
  3. each window is one forward pass with a fresh cache built with ``quantize_prefill=True``, so the
     attention of every layer sees the keys/values as the cache stores them (dequantized);
  4. perplexity = exp(mean NLL over every predicted token: ``window - 1`` per window).
Memory: ``kv_bytes_per_token`` = the cache's real stored bytes after the window (``nbytes``: packed buffers
plus the full-precision residual tokens, K and V, every layer) / ``window`` tokens, the mean over windows:
what the accuracy of this run was bought with (the x of the memory-accuracy frontier, scripts/frontier.py).
predictions.jsonl holds one record per window (start, tokens, summed nll, kv_bytes): a killed run resumes
at the window in flight.

What "quantized" means here: the whole window is handed to the cache at once and flushed by the
method's policy, so the tokens left in the residual window stay in full precision (none under the
``block`` policy when ``window`` is a multiple of R; the last R values under ``kivi``), and a
token's group statistics (per-channel key groups of G tokens) include the later tokens of its group,
which the causal mask hides from it: this is the standard fake-quant evaluation, not a replay of
token-by-token decoding.

Data: a local ``.jsonl`` of rows ``{"text": ...}`` (the hub split as is) or a ``.txt`` file; a
relative path is looked up in the data folders (oscar.paths: $OSCAR_DATA, ../shared/data, the cache
``make data`` fills), then against the repository root. ``path=None`` loads the hub dataset
``wikitext`` / ``wikitext-2-raw-v1`` through ``datasets`` (needs network).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from evals.base import Headline, Task, TaskResult, register_task
from evals.datafiles import DataError, read_jsonl
from evals.tables import line_table, write_table
from oscar.lm import KVModel, cache_argument
from oscar.options import bounded
from oscar.paths import DataNotFoundError, locate_data, resolve_data
from oscar.results import NUMBER, PredictionLog

log = logging.getLogger(__name__)

#: the hub split as rows, inside the data folder (``make data`` writes it; see README "Data")
DEFAULT_WIKITEXT = "text/wikitext-2-raw-v1.test.rows.jsonl"
HUB_DATASET = ("wikitext", "wikitext-2-raw-v1", "test")


def check_text_source(path: str | None) -> None:
    """Raise a clear error before any model load: a missing, unsupported, malformed or empty local
    file (read and parsed: file and line named), or a hub dataset that cannot be loaded (loaded once
    here; ``datasets`` caches it for the run)."""
    if path is None:
        _hub_rows()
        return
    if Path(path).suffix not in (".jsonl", ".txt"):
        raise ValueError(f"text file must be .jsonl (rows {{'text': ...}}) or .txt, got {path}")
    try:
        p = resolve_data(path)
    except DataNotFoundError as e:
        where = "" if Path(path).expanduser().is_absolute() else f" ({e})"  # a relative name: every place looked
        raise DataNotFoundError(f"text file not found: {path}{where}; or set task.path=null to load the hub "
                                f"dataset") from None
    if not p.is_file():
        raise ValueError(f"text file {p} is a folder (from path={path!r})")
    if not "".join(load_text_rows(path)).strip():
        raise DataError(f"{p}: no text (the corpus is empty)")


def load_text_rows(path: str | None) -> list[str]:
    """The rows of the corpus: local .jsonl rows, a .txt file as one row, or the hub split when ``path`` is None."""
    if path is None:
        return _hub_rows()
    p = resolve_data(path)
    if p.suffix == ".txt":
        try:
            return [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start:,})") from None
    rows = read_jsonl(p, required=["text"])
    for n, row in enumerate(rows, 1):
        if not isinstance(row["text"], str):
            raise DataError(f"{p}: record {n}: 'text' must be a string, got {type(row['text']).__name__}")
    return [row["text"] for row in rows]


def _hub_rows() -> list[str]:
    name, config, split = HUB_DATASET
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError("loading the hub dataset needs the `datasets` package (pip install 'oscar-kv[eval]'), "
                           "or pass a local file with path=...") from e
    try:
        return list(datasets.load_dataset(name, config, split=split)["text"])
    except (ConnectionError, OSError) as e:
        raise RuntimeError(f"could not load the hub dataset {name}/{config} ({split}): no network or no cached "
                           f"copy ({type(e).__name__}: {e}). Pass a local copy instead, e.g. "
                           f"path={DEFAULT_WIKITEXT}") from e


def corpus_name(path: str | None) -> str:
    """A short name for the rows' subset column: the hub config, or the file name up to its first dot."""
    return HUB_DATASET[1] if path is None else Path(path).name.split(".")[0]


def tokenize_corpus(lm: KVModel, path: str | None) -> torch.Tensor:
    """The corpus joined with "\\n\\n" (the standard WikiText protocol), tokenized once: [N] long."""
    text = "\n\n".join(load_text_rows(path))
    return torch.tensor(lm.tokenizer(text)["input_ids"], dtype=torch.long)


#: what a logged window holds (a record without them is computed again)
WINDOW_FIELDS = dict(start=int, tokens=int, nll=NUMBER)
#: extra tokens a tokenized prefix of the corpus must hold to stand for the whole (the cut may split a word)
PREFIX_MARGIN = 16


def corpus_token_count(tokenizer, path: str | None, at_least: int) -> int:
    """The corpus's tokens as :func:`tokenize_corpus` counts them when it has fewer than ``at_least``, else a number
    >= ``at_least``: a prefix that already holds enough (checked before the weights load, cheaply) is all that is
    tokenized."""
    text = "\n\n".join(load_text_rows(path))
    chars = 16 * (at_least + PREFIX_MARGIN)
    while chars < len(text):
        tokens = len(tokenizer(text[:chars])["input_ids"])
        if tokens >= at_least + PREFIX_MARGIN:
            return tokens
        chars *= 4
    return len(tokenizer(text)["input_ids"])


@torch.no_grad()
def window_nll(lm: KVModel, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL of one window ids [T] (T - 1 predictions), attention on the cache's K/V, and the
    bytes the cache then stores (``nbytes``: every layer's packed K/V plus its full-precision residual)."""
    ids = ids.to(lm.device)
    cache = lm.new_cache(quantize_prefill=True)
    logits = lm.model(input_ids=ids[None], **cache_argument(lm.model, cache)).logits
    return F.cross_entropy(logits[0, :-1].float(), ids[1:], reduction="sum").item(), cache.nbytes


@register_task("perplexity")
@dataclass
class Perplexity(Task):
    path: str | None = DEFAULT_WIKITEXT
    window: int = bounded(2048, ge=2)
    max_windows: int | None = bounded(4, ge=1)  # null = all

    headline = (Headline("perplexity", higher_is_better=False),)
    option_words = {"max_windows": lambda v: "all windows" if v == "null" else f"{v} windows",
                    "window": lambda v: f"windows of {v} tokens", "path": lambda v: f"text {v}"}

    def check(self) -> None:
        check_text_source(self.path)

    # -- tables -------------------------------------------------------------------------------
    @classmethod
    def sample_words(cls, row: dict) -> str:
        return f"{int(row['n']):,} tokens"

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/perplexity: per line and corpus the tokens scored, the perplexity and the KV bytes per token."""
        header, body = line_table(rows, "perplexity", None, [("perplexity", "perplexity", 2),
                                                             ("kv_bytes_per_token", "KV bytes / token", 0)],
                                  "tokens scored")
        return write_table(out, "perplexity", header, body, "Perplexity (lower is better) and the KV cache's "
                                                              "stored bytes per token") if body else []

    def check_context(self, max_length: int) -> None:
        if self.window > max_length:
            raise ValueError(f"perplexity: window={self.window} exceeds the model's max_length {max_length} (task.window)")

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a corpus shorter than one window (the run would score nothing)."""
        tokens = corpus_token_count(tokenizer, self.path, self.window)
        if tokens < self.window:
            raise ValueError(f"perplexity: the corpus {self.path or 'wikitext-2 (hub)'} has {tokens} tokens of this "
                             f"model, fewer than one window of {self.window} (task.window)")

    def data_files(self) -> list[Path]:
        return [] if self.path is None else [locate_data(self.path)]

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        self.check_context(lm.max_length)
        ids = tokenize_corpus(lm, self.path)
        available = len(ids) // self.window
        if available == 0:
            raise ValueError(f"perplexity: the corpus has {len(ids)} tokens, fewer than one window of {self.window}")
        n_windows = available if self.max_windows is None else min(available, self.max_windows)
        log.info("perplexity: %d tokens, %d windows of %d (of %d available)", len(ids), n_windows, self.window,
                 available)

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        predictions = PredictionLog(Path(run_dir) / "predictions.jsonl", WINDOW_FIELDS)
        records = []
        for i in tqdm(range(n_windows), desc=f"perplexity {lm.method.name}", unit="window"):
            key = f"window{i}"
            record = predictions.done.get(key)
            if record is None:
                start = i * self.window
                nll, kv_bytes = window_nll(lm, ids[start:start + self.window])
                n = self.window - 1
                record = predictions.write(key, dict(start=start, tokens=n, nll=nll, perplexity=math.exp(nll / n),
                                                     kv_bytes=kv_bytes))
            records.append(record)

        total_nll, total_tokens = sum(r["nll"] for r in records), sum(r["tokens"] for r in records)
        perplexity = math.exp(total_nll / total_tokens)
        subset = corpus_name(self.path)
        metrics = dict(perplexity=perplexity, nll_mean=total_nll / total_tokens, n_tokens=total_tokens,
                       n_windows=n_windows)
        rows = [dict(subset=subset, metric="perplexity", value=perplexity, n=total_tokens)]
        if all("kv_bytes" in r for r in records):  # windows logged before the bytes were recorded have none
            metrics["kv_bytes_per_token"] = sum(r["kv_bytes"] for r in records) / (n_windows * self.window)
            rows.append(dict(subset=subset, metric="kv_bytes_per_token", value=metrics["kv_bytes_per_token"],
                             n=n_windows * self.window))
        return TaskResult(metrics=metrics, rows=rows)
