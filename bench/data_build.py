"""Data builder throughput: embedding + clustering on CPU, and teacher calls against a slow loopback server.

    python bench/data_build.py [--sizes 10000 100000] [--embedders minilm hashing] [--minilm-max-entries N]
                               [--latency 0.2] [--concurrency 16] [--sets 64]

Part 1 embeds synthetic entries (tags + captions drawn from topic vocabularies) and
clusters them at the paper's threshold (0.75) with the blocked numpy search and, when
faiss-cpu is installed, with faiss (flat = exact; IVF = approximate); entries/s counts
embedding plus clustering. Part 2 runs the generate stage on image sets against a
loopback OpenAI-compatible server that answers after ``--latency`` seconds; the ideal
wall time is calls * latency / concurrency. A second pass shows a resumed run: every
reply comes from the cache, no calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOPICS = {
    "astronomy": "planet star telescope orbit galaxy nebula comet moon crater eclipse",
    "architecture": "building facade tower bridge window arch column dome roof bricks",
    "botany": "flower leaf petal stem tree seed root blossom garden fern",
    "cooking": "pasta sauce oven bread soup spice recipe tomato cheese salad",
    "sport": "football stadium player goal match racket tennis runner track ball",
    "ocean": "wave coral fish reef shore boat whale beach tide lighthouse",
    "machines": "engine gear motor turbine piston lever wheel pump valve shaft",
    "painting": "canvas brush portrait fresco colour palette gallery oil sketch frame",
}


def synthetic_texts(n: int, seed: int = 0) -> list[str]:
    """Entry texts (tags ; captions) whose topic shows in their words, like a real corpus."""
    rng = random.Random(seed)
    names = list(TOPICS)
    texts = []
    for _ in range(n):
        topic = rng.choice(names)
        words = TOPICS[topic].split()
        tags = [topic, f"{rng.choice(words)} pictures"]
        captions = [" ".join(["a", *rng.sample(words, 3), "photo"]) for _ in range(2)]
        texts.append(" ; ".join(tags + captions))
    return texts


# --------------------------------------------------------------------------- loopback teacher


class _Server(ThreadingHTTPServer):
    # The default listen backlog (5) drops connections when many clients connect at once.
    request_queue_size = 256
    daemon_threads = True


class SlowTeacher:
    """``/v1/chat/completions`` on 127.0.0.1 answering every call after ``latency`` seconds."""

    def __init__(self, latency: float):
        self.latency = latency
        self.count = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                msg = body["messages"][-1]["content"]
                prompt = msg if isinstance(msg, str) else "".join(p.get("text", "") for p in msg if p.get("type") == "text")
                time.sleep(outer.latency)
                with lock:
                    outer.count += 1
                if "named Image1 to Image" in prompt:
                    qa = [{"question": "How do Image1 and Image2 differ?", "answer": "Image1 is brighter than Image2."}]
                else:
                    qa = [{"question": "What does the image show?", "answer": "A coloured shape on white."}]
                content = json.dumps({"qa": qa})
                data = json.dumps({
                    "id": "b", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(content) // 4, "total_tokens": 0},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- parts


def bench_grouping(sizes: list[int], embedder_kind: str, threshold: float, max_entries: int) -> list[dict]:
    from mmtune.data.build.clustering import cluster_embeddings, faiss_available
    from mmtune.data.build.config import ClusterConfig
    from mmtune.data.build.embedding import HashingEmbedder, SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder(batch_size=128) if embedder_kind == "minilm" else HashingEmbedder(256)
    rows = []
    for n in sizes:
        if n > max_entries:
            print(f"  ... {n} entries with {embedder_kind}: skipped (above --{embedder_kind}-max-entries)")
            continue
        texts = synthetic_texts(n)
        t = time.perf_counter()
        emb = embedder.encode(texts)
        embed_s = time.perf_counter() - t
        backends = [("blocked", ClusterConfig(threshold=threshold, index="blocked", block_size=1024))]
        if faiss_available():
            backends.append(("faiss flat", ClusterConfig(threshold=threshold, index="faiss", faiss_ivf_min=10**12)))
            backends.append(("faiss ivf", ClusterConfig(threshold=threshold, index="faiss", faiss_ivf_min=0)))
        for name, cfg in backends:
            t = time.perf_counter()
            clusters, _ = cluster_embeddings(emb, cfg)
            cluster_s = time.perf_counter() - t
            rows.append({
                "entries": n, "embedder": embedder_kind, "search": name, "embed_s": embed_s, "cluster_s": cluster_s,
                "entries_per_s": n / (embed_s + cluster_s), "clusters": len(clusters),
                "clustered": sum(len(c) for c in clusters),
            })
            print(f"  ... {n} entries, {name}: embed {embed_s:.1f}s, cluster {cluster_s:.1f}s", flush=True)
    return rows


def bench_teacher(n_sets: int, latency: float, concurrency: int) -> list[dict]:
    from omegaconf import OmegaConf

    from mmtune.data.build.config import BuildConfig
    from mmtune.data.build.demo_corpus import generate_corpus
    from mmtune.data.build.pipeline import Plan, generate_shard
    from mmtune.data.build.sets import ImageSet, SetImage

    server = SlowTeacher(latency)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = generate_corpus(Path(tmp) / "c", entries=2 * n_sets, images_per_entry=1, image_size=32)
        lines = [json.loads(x) for x in corpus.read_text().splitlines()]
        images = [SetImage(x["id"], str(corpus.parent / x["images"][0]), x["captions"][0], tuple(x["tags"]), x["text"])
                  for x in lines]
        sets = [ImageSet(f"{i:016x}", 0, (images[2 * i], images[2 * i + 1])) for i in range(n_sets)]
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BuildConfig), OmegaConf.from_dotlist([
            f"corpus.path={corpus}", f"output.dir={tmp}/out", f"teacher.concurrency={concurrency}",
            "teacher.max_retries=0", "prompts.per_image_pairs=1", "prompts.cross_image_pairs=1",
        ])))
        env = {"MMTUNE_TEACHER_BASE_URL": server.base_url, "MMTUNE_TEACHER_MODEL": "bench-teacher"}
        for label in ("first run", "resumed (all cached)"):
            before = server.count
            stats = generate_shard(cfg, Plan(sets), env=env)
            calls = server.count - before
            ideal = calls * latency / concurrency
            rows.append({"pass": label, "sets": n_sets, "calls": calls, "wall_s": stats["wall_s"], "ideal_s": ideal,
                         "retries": stats["teacher"]["retries"], "failed": stats["teacher"]["failed"],
                         "calls_per_s": calls / stats["wall_s"] if stats["wall_s"] else 0.0})
            # the second pass: a fresh shard folder pointing at the same cache is a resume
            # without checkpoint, so every call is answered by the reply cache
            ckpt = Path(tmp) / "out" / "shards" / "0-of-1" / "dialogues.jsonl"
            ckpt.unlink()
    server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--embedders", nargs="+", choices=("minilm", "hashing"), default=["hashing", "minilm"])
    parser.add_argument("--minilm-max-entries", type=int, default=10**9,
                        help="skip the model embedder above this many entries (it is the slow part on a small CPU)")
    parser.add_argument("--threshold", type=float, default=0.75)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sets", type=int, default=128)
    args = parser.parse_args()

    print(f"cpu threads: torch/numpy may use up to {os.cpu_count()} cores (shared machine: figures vary run to run)")
    teacher = bench_teacher(args.sets, args.latency, args.concurrency)
    grouping = []
    for kind in args.embedders:
        limit = args.minilm_max_entries if kind == "minilm" else 10**12
        grouping += bench_grouping(args.sizes, kind, args.threshold, limit)

    print(f"\nembedding + clustering (threshold {args.threshold}, CPU)")
    print(f"{'entries':>8} {'embedder':>8} {'search':>11} {'embed s':>8} {'cluster s':>9} {'entries/s':>10} "
          f"{'clusters':>8} {'clustered':>9}")
    for r in grouping:
        print(f"{r['entries']:>8} {r['embedder']:>8} {r['search']:>11} {r['embed_s']:>8.1f} {r['cluster_s']:>9.1f} "
              f"{r['entries_per_s']:>10.0f} {r['clusters']:>8} {r['clustered']:>9}")
    print(f"\nteacher calls (loopback, {args.latency * 1000:.0f} ms latency, concurrency {args.concurrency})")
    print(f"{'pass':>22} {'sets':>5} {'calls':>6} {'wall s':>7} {'ideal s':>8} {'wall/ideal':>10} {'calls/s':>8} "
          f"{'retries':>7} {'failed':>6}")
    for r in teacher:
        ratio = f"{r['wall_s'] / r['ideal_s']:.2f}" if r["ideal_s"] else "-"
        print(f"{r['pass']:>22} {r['sets']:>5} {r['calls']:>6} {r['wall_s']:>7.2f} {r['ideal_s']:>8.2f} "
              f"{ratio:>10} {r['calls_per_s']:>8.1f} {r['retries']:>7} {r['failed']:>6}")


if __name__ == "__main__":
    main()
