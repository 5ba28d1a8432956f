"""``python -m benchmarks QUESTION [options]``: run one question (benchmarks/__init__.py says what a question is)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from benchmarks import load_question, questions
from benchmarks.harness import RESULTS, Run
from oscar.paths import DataNotFoundError


def question_list() -> str:
    lines = ["questions:"]
    for name, module in questions().items():
        lines.append(f"  {name:16s} {(module.__doc__ or '').strip().splitlines()[0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = argparse.ArgumentParser(prog="python -m benchmarks", description="Run one measurement question.",
                                  epilog=question_list() + "\n\nA question's options: python -m benchmarks QUESTION "
                                  "--help. A module file being written: python -m benchmarks path/to/question.py.",
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("question", help="a question below, or a question module's file")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return None
    try:
        module = load_question(argv[0])
    except ValueError as e:
        top.error(str(e))
    name = Path(argv[0]).stem if argv[0].endswith(".py") else argv[0]
    # no abbreviations: the arguments a row records are the command that reproduces it, as typed
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=None, help=f"the folder of {name}.csv (default: {RESULTS})")
    parser.add_argument("--budget", type=float, default=math.inf,
                        help="seconds; the cells that would start later are skipped (default: %(default)s)")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])  # an unknown method or model: one line here, before any work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = getattr(args, "device", None) or getattr(module, "DEVICE", None)  # where it measures, if not the GPU
    bench = Run(name, argv[1:], args.out or RESULTS, getattr(module, "FIELDS", ()), args.budget, device)
    try:
        module.run(args, bench)
    except DataNotFoundError as e:  # the rows measured before it are written already
        raise SystemExit(f"{name}: {e}") from None
    written = [bench.path(table) for table in bench.tables]
    logging.getLogger("benchmarks").info("%s: %s", name, ", ".join(map(str, written)) or "no rows measured")
    return written[0] if written else None


if __name__ == "__main__":
    main()
