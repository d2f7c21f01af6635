"""Where a py-spy profile's samples fall: the top functions by own time and by time inclusive.

    python -m lab.experiments.spy_top FILE.txt [FILE.txt ...] [--top 25]

FILE: `py-spy record -f raw` output (lab/suites/spy_services.sh writes them), one collapsed stack per
line: `frame;frame;...;frame COUNT`, a frame being `function (file:line)`. "Own" charges a sample to the
innermost frame of the project's code (services/, scheduler/, engine/, tokenization/...) on its stack, or to
the innermost frame when none is ours, so a library call is counted where our code made it; "inclusive"
charges it to every distinct function on the stack.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

OURS = ("services/", "scheduler/", "engine/", "tokenization/", "kvtransfer/", "loadtest/")


def function(frame: str) -> str:
    """`Tokenizer.encode (tokenization/tokenizer.py:94)` -> `Tokenizer.encode (tokenization/tokenizer.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def tally(lines: Iterable[str]) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, own, inclusive) over raw collapsed-stack lines."""
    total, own, inclusive = 0, Counter[str](), Counter[str]()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [function(f) for f in stack.split(";") if f] or ["<no frame>"]
        ours = [f for f in frames if any(part in f for part in OURS)]
        own[ours[-1] if ours else frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    return total, own, inclusive


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lab.experiments.spy_top", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for path in args.files:
        total, own, inclusive = tally(path.read_text().splitlines())
        print(f"== {path}: {total} samples")
        if not total:
            continue
        for title, counts in (("own", own), ("inclusive", inclusive)):
            print(f"-- {title}")
            for name, n in counts.most_common(args.top):
                print(f"{n:7d} {100 * n / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
