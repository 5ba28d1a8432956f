"""Build a small LongBench-format fixture from real QA data (LongBench-E rows cannot be downloaded here).

    python scripts/longbench_fixture.py OUT_DIR [--per-subset 4] [--words 600 1500 3000 5000]

From qa/ in the data folder (HotpotQA dev distractor and SQuAD 2.0 dev; oscar.paths) it writes, one ``<subset>.jsonl``
per subset, rows with LongBench's fields (input, context, answers, length, dataset, language,
all_classes, _id), contexts padded with real paragraphs to about the requested word counts:
  hotpotqa_e           HotpotQA questions; context = "Passage i:" blocks (gold + distractor paragraphs)
  multifieldqa_en_e    SQuAD questions; context = paragraphs of the question's Wikipedia article
  passage_count_e      SQuAD paragraphs, some repeated, shuffled; answer = number of distinct ones
  passage_retrieval_en_e  "Paragraph i:" blocks; input = a SQuAD question standing in for the abstract
The last two follow LongBench's synthetic construction; the stand-ins are stated here, not hidden.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from oscar.paths import data_file


def _row(subset: str, i: int, question: str, context: str, answers: list[str]) -> dict:
    return {"input": question, "context": context, "answers": answers, "length": len(context.split()),
            "dataset": subset, "language": "en", "all_classes": None, "_id": f"{subset}-{i}"}


def _squad_paragraphs(squad: dict) -> list[tuple[str, str, list[dict]]]:
    """(article title, paragraph text, answerable questions) for every SQuAD paragraph."""
    out = []
    for article in squad["data"]:
        for p in article["paragraphs"]:
            out.append((article["title"], p["context"], [q for q in p["qas"] if not q["is_impossible"]]))
    return out


def hotpotqa(hotpot: list[dict], n: int, words: list[int], rng: random.Random) -> list[dict]:
    filler = [(title, "".join(sents)) for ex in hotpot[n:n + 400] for title, sents in ex["context"]]
    rows = []
    for i, ex in enumerate(hotpot[:n]):
        passages = [(title, "".join(sents)) for title, sents in ex["context"]]
        while sum(len(t.split()) for _, t in passages) < words[i % len(words)]:
            passages.append(filler[rng.randrange(len(filler))])
        rng.shuffle(passages)
        context = "\n\n".join(f"Passage {j + 1}:\n{title}\n{text}" for j, (title, text) in enumerate(passages))
        rows.append(_row("hotpotqa_e", i, ex["question"], context, [ex["answer"]]))
    return rows


def multifieldqa(squad: dict, n: int, words: list[int], rng: random.Random) -> list[dict]:
    rows = []
    size = {a["title"]: sum(len(p["context"].split()) for p in a["paragraphs"]) for a in squad["data"]}
    for i in range(n):
        long_enough = [a for a in squad["data"] if size[a["title"]] >= words[i % len(words)]]
        article = (long_enough or sorted(squad["data"], key=lambda a: -size[a["title"]]))[i % max(len(long_enough), 1)]
        paragraphs = [p["context"] for p in article["paragraphs"]]
        qas = [(j, q) for j, p in enumerate(article["paragraphs"]) for q in p["qas"] if not q["is_impossible"]]
        j, qa = qas[rng.randrange(len(qas))]
        keep, total = [j], len(paragraphs[j].split())
        for k in range(len(paragraphs)):
            if total >= words[i % len(words)]:
                break
            if k != j:
                keep.append(k)
                total += len(paragraphs[k].split())
        context = "\n\n".join([article["title"].replace("_", " ")] + [paragraphs[k] for k in sorted(keep)])
        answers = sorted({a["text"] for a in qa["answers"]})
        rows.append(_row("multifieldqa_en_e", i, qa["question"], context, answers))
    return rows


def passage_count(paragraphs: list, n: int, words: list[int], rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        unique, total = [], 0
        while total < words[i % len(words)] * 0.7:
            text = paragraphs[rng.randrange(len(paragraphs))][1]
            if text not in unique:
                unique.append(text)
                total += len(text.split())
        blocks = unique + [rng.choice(unique) for _ in range(max(1, len(unique) // 3))]
        rng.shuffle(blocks)
        context = "\n\n".join(f"Paragraph {j + 1}: {text}" for j, text in enumerate(blocks))
        rows.append(_row("passage_count_e", i, "", context, [str(len(unique))]))
    return rows


def passage_retrieval(paragraphs: list, n: int, words: list[int], rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        chosen, total = [], 0
        while total < words[i % len(words)] or len(chosen) < 2:
            candidate = paragraphs[rng.randrange(len(paragraphs))]
            if candidate[2] and candidate not in chosen:
                chosen.append(candidate)
                total += len(candidate[1].split())
        gold = rng.randrange(len(chosen))
        context = "\n\n".join(f"Paragraph {j + 1}: {text}" for j, (_, text, _) in enumerate(chosen))
        question = chosen[gold][2][0]["question"]
        rows.append(_row("passage_retrieval_en_e", i, question, context, [f"Paragraph {gold + 1}"]))
    return rows


def build_fixture(out_dir: Path, per_subset: int = 4, words: list[int] | None = None, seed: int = 0) -> list[Path]:
    """Write the four fixture subsets under ``out_dir``; returns the files."""
    words = words or [600, 1500, 3000, 5000]
    rng = random.Random(seed)
    hotpot = json.loads(data_file("qa/ruler_hotpotqa_dev_distractor.json").read_text())
    squad = json.loads(data_file("qa/ruler_squad_v2_dev.json").read_text())
    paragraphs = _squad_paragraphs(squad)
    subsets = {
        "hotpotqa_e": hotpotqa(hotpot, per_subset, words, rng),
        "multifieldqa_en_e": multifieldqa(squad, per_subset, words, rng),
        "passage_count_e": passage_count(paragraphs, per_subset, words, rng),
        "passage_retrieval_en_e": passage_retrieval(paragraphs, per_subset, words, rng),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for subset, rows in subsets.items():
        path = out_dir / f"{subset}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        files.append(path)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--per-subset", type=int, default=4)
    parser.add_argument("--words", type=int, nargs="+", default=[600, 1500, 3000, 5000],
                        help="target context lengths in words, cycled over the samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in build_fixture(args.out_dir, args.per_subset, args.words, args.seed):
        print(path)


if __name__ == "__main__":
    main()
