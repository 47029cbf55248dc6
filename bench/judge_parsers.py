"""Judge-reply parsers on hostile replies: time as the reply doubles, before and after.

    OMP_NUM_THREADS=1 python bench/judge_parsers.py --sizes 2000 4000 8000 16000

A reply of one long digit run after a score key ("Creativity: 1111...1x1") made the MMDU
and MM-Vet number patterns backtrack over the run once per digit (quadratic: 2.4 s for
16k digits); a reply of many answer labels made the MDI reader copy the rest of the reply
once per label. Prints, for each reply size, the seconds per parse of the earlier
patterns (MMDU's and MM-Vet's kept here verbatim; for MDI the earlier copy-per-label loop
around mmtune's own patterns) and of mmtune's, and the growth ratio t(2n) / t(n): about 4
is quadratic, about 2 linear. mmtune's MMDU parser also reads at
most the last ``MAX_REPLY_CHARS`` characters, so its time stops growing there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from mmtune.evaluation.benchmarks.mdi import _LABEL, _PREFIX, extract_option  # noqa: E402
from mmtune.evaluation.benchmarks.mmdu import _KEY_RE, parse_scores  # noqa: E402
from mmtune.evaluation.benchmarks.mmvet import parse_correctness  # noqa: E402

# The earlier patterns, for the side-by-side timing only.
_OLD_VALUE = r"(?P<value>N\s*/\s*A|NA|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w.]*\d))"
_OLD_PAIR = re.compile(rf"[\"'*]*\b(?:{_KEY_RE})\b[\"'*]*\s*[:=：]\s*[\"'*]*\s*{_OLD_VALUE}", re.IGNORECASE)
_OLD_NUMBER = re.compile(r"^[\s\"'*]*(\d+(?:\.\d+)?|\.\d+)(?![\w.]*\d)")


def old_mmdu(reply: str) -> None:
    for _ in _OLD_PAIR.finditer(reply):
        pass


def old_mmvet(reply: str) -> None:
    _OLD_NUMBER.match(reply)


def old_mdi(reply: str) -> None:
    for match in reversed(list(_LABEL.finditer(reply))):
        _PREFIX.sub("", reply[match.end():], count=1)  # a copy of the rest of the reply per label


CASES = {
    "mmdu": (lambda n: "Creativity: " + "1" * n + "x1", old_mmdu, parse_scores),
    "mmvet": (lambda n: "1" * n + "x1", old_mmvet, parse_correctness),
    "mdi": (lambda n: "answer " * (n // 7) + "Answer: B", old_mdi,
            lambda reply: extract_option(reply, {"A": "1", "B": "2", "C": "3"})),
}


def seconds(fn, reply: str, budget: float = 0.5) -> float:
    """Mean seconds per call over as many calls as fit in ``budget`` (at least one)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn(reply)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 4000, 8000, 16000])
    args = parser.parse_args()
    for name, (make, old, new) in CASES.items():
        print(f"{name}: reply size, earlier s/parse, mmtune s/parse, growth t(2n)/t(n) earlier | mmtune")
        previous = None
        for n in args.sizes:
            reply = make(n)
            t_old, t_new = seconds(old, reply), seconds(new, reply)
            growth = (f"{t_old / previous[0]:5.2f} | {t_new / previous[1]:5.2f}" if previous else "    - |     -")
            print(f"  {len(reply):>8}  {t_old:10.6f}  {t_new:10.6f}  {growth}")
            previous = (t_old, t_new)


if __name__ == "__main__":
    main()
