"""The demo's training step time at this checkout beside another commit, run at the same time.

    python bench/demo_steps.py --against 90ae18d --threads 1 --steps 40 --rounds 2
    python bench/demo_steps.py --against 90ae18d --threads 2 --steps 100    # on an idle machine only

Exports ``--against`` with ``git archive`` into a temporary folder, then runs ``mmtune demo``
(``training.max_steps=N``, no evaluation) from both trees in two processes started together,
so a busy machine slows both alike, and prints each one's median ``perf/step_time_s`` of
``metrics.jsonl`` (the first 3 steps left out) and their ratio. Wall times mean nothing on a
shared machine; the ratio does. With ``--threads 2`` the two runs share the cores with each
other: on a 2-core machine compare ``--threads 2`` runs one tree at a time
(``--one-at-a-time``), on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _export(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _start(tree: Path, out: Path, steps: int, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "mmtune.cli", "demo", f"training.output_dir={out}", f"training.max_steps={steps}",
            "training.eval_before=false", "training.eval_after=false"]
    return subprocess.Popen(args, cwd=tree, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _median_step(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["perf/step_time_s"] for r in rows if r["step"] > 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=True, help="the commit to compare with (e.g. the one a figure was measured at)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--one-at-a-time", action="store_true", help="run the two trees one after the other")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "other").mkdir()
        trees = {"this": REPO, args.against: _export(args.against, Path(tmp) / "other")}
        for round_ in range(1, args.rounds + 1):
            medians = {}
            runs = []
            for name, tree in trees.items():
                out = Path(tmp) / f"out-{name}"  # kept across rounds: the data is generated once per tree
                proc = _start(tree, out, args.steps, args.threads, Path(tmp) / f"{name}-{round_}.log")
                if args.one_at_a_time:
                    proc.wait()
                runs.append((name, proc, out))
            for name, proc, out in runs:
                # without evaluation the demo has no score and exits 1 ("below the target"): the steps
                # it logged are what is measured
                proc.wait()
                if not (out / "metrics.jsonl").is_file():
                    sys.exit(f"{name}: exit {proc.returncode}:\n" + (Path(tmp) / f"{name}-{round_}.log").read_text()[-3000:])
                medians[name] = _median_step(out)
            shown = ", ".join(f"{name} {value:.4f} s" for name, value in medians.items())
            print(f"round {round_}: median step time {shown}; this / {args.against} = "
                  f"{medians['this'] / medians[args.against]:.2f} ({args.threads} thread(s) each, "
                  f"{'one at a time' if args.one_at_a_time else 'side by side'})", flush=True)


if __name__ == "__main__":
    main()
