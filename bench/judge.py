"""Judge client throughput against a loopback server with fixed latency.

    python bench/judge.py [--requests 200] [--latency 0.1] [--concurrency 16]

Ideal wall time is N * latency / concurrency; the ratio shows the client's overhead
(thread pool, SDK, SQLite cache writes). A second pass over the same requests is served
from the cache and should make no calls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# The loopback judge server is test tooling (tests/support/), not part of the installed
# package: make the repository root importable so `tests.support` resolves.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    from mmtune.evaluation.config import JudgeConfig
    from tests.support.fake_judge import FakeJudgeServer, Scripted
    from mmtune.evaluation.judge.client import JudgeClient, JudgeRequest

    reply = '{"Creativity": 5, "Richness": 5, "Visual Perception": 5, "Logical Coherence": 5, "Answer Accuracy": 5, "Image Relationship Understanding": 5, "Overall Score": 5}'
    requests = [JudgeRequest(f"question {i}: " + "context " * 200) for i in range(args.requests)]
    with FakeJudgeServer(lambda body: Scripted(reply, delay_s=args.latency)) as server, tempfile.TemporaryDirectory() as tmp:
        cfg = JudgeConfig(model="bench-judge", concurrency=args.concurrency)
        client = JudgeClient(cfg, cache_path=Path(tmp) / "cache.sqlite", env={"MMTUNE_JUDGE_BASE_URL": server.base_url})
        client.judge(JudgeRequest("warm-up"))  # connection set-up is not part of the figure
        start = time.perf_counter()
        replies = client.judge_many(requests)
        wall = time.perf_counter() - start
        start = time.perf_counter()
        client.judge_many(requests)
        cached = time.perf_counter() - start
        calls = len(server.requests) - 1
        client.close()
    ideal = args.requests * args.latency / args.concurrency
    print(f"{args.requests} requests, latency {args.latency * 1000:.0f} ms, concurrency {args.concurrency}")
    if ideal > 0:
        print(f"wall {wall:.3f}s vs ideal {ideal:.3f}s -> ratio {wall / ideal:.3f} (goal <= 1.2)")
    else:
        print(f"wall {wall:.3f}s: {1000 * wall / args.requests:.2f} ms of client + server overhead per request")
    print(f"max in flight at the server: {server.max_in_flight}; calls {calls}; all ok: {all(r.ok for r in replies)}")
    print(f"second pass from cache: {cached:.3f}s, new calls: {len(server.requests) - 1 - calls}")


if __name__ == "__main__":
    main()
