"""Multi-turn generation cost: batch-1 KV reuse, batched KV reuse and batched re-encoding, side by
side; data-parallel ranks; a served model behind the api backend.

    python bench/eval_generation.py [--dialogues 32] [--turns 10] [--images 6] [--max-new-tokens 24]
                                    [--batch-sizes 4,8,16] [--lockstep-batch 8] [--reencode-batch 8] [--raw]
    python bench/eval_generation.py --part ranks [--ranks 2] [--dialogues 32] [--batch-sizes 4]
    python bench/eval_generation.py --part api [--dialogues 64] [--turns 10] [--latency 0.1] [--concurrency 16]

``--part paths`` (the default) compares the generator's paths in one process. ``--part
ranks`` answers the same dialogues with 1 process and with ``--ranks`` processes
(torchrun, gloo, one CPU thread each; :mod:`mmtune.evaluation.generation.data_parallel`)
and prints wall time and each rank's work side by side, and whether the gathered file
equals the one-process file. ``--part api`` answers the dialogues through the ``api``
backend against a loopback server that answers each request after ``--latency`` seconds,
``--concurrency`` dialogues at once, and prints the wall time against the ideal (every
slot busy: ``max(turns / concurrency, longest dialogue) * latency``).

An MMDU-shaped workload: ``--dialogues`` dialogues of ``--turns`` turns on average (the
count varies by up to 3 either way, so slots free up at different times), each bringing
``--images`` images in its first turns (two at once in some turns), later turns asking
about them. The model is a random-weight LLaVA (4-layer 256-wide Llama, 64 tokens per
image): small enough for a CPU, big enough that the image tokens dominate the prompts
as they do in MMDU.

The KV rows use continuous batching (a row starts its next turn as soon as its answer
ends); "KV lockstep" starts all rows' turns together, after the longest answer.

Reported per path: model forward calls, tokens run through the model (real tokens and
padding separately; "idle" is the part of the padding fed by rows whose answer had
already ended while others decode, the rest pads the prefill of each round to its
longest row), batched-cache compactions, wall time, and whether the answers equal the batch-1 KV path's.
"dialogue length" is the sum over dialogues of the final sequence (last prompt + last
answer): the KV paths run each of those tokens about once, re-encoding about T/2 times.

Answers are made to look like a trained model's, so the counts mean what they would
mean on one: the stop token's output row is scaled (``--stop-scale``) so answers end at
different lengths instead of all running to ``--max-new-tokens``; partial-UTF-8 byte
tokens are banned and every answer is kept in the tokenizer's canonical tokenization
with a leading space, so it re-tokenizes to the ids that were generated (a random
model's raw byte soup re-tokenizes differently, which makes the cache roll back every
turn; ``--raw`` shows that).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The loopback server is test tooling (tests/support/), not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH_ARCHITECTURE = {
    "text_config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                    "num_attention_heads": 8, "num_key_value_heads": 4},
    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 112, "patch_size": 14},
}


def build_dialogues(n: int, turns: int, images: int, root: str, seed: int = 0):
    from PIL import Image as PILImage

    from mmtune.data.dialogue import Dialogue, Image, Turn

    rng = random.Random(seed)
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "cyan", "magenta", "gray", "brown"]
    dialogues = []
    for d in range(n):
        count = max(1, turns + rng.randint(-3, 3))
        shown = 0
        out = []
        for t in range(count):
            take = min(images - shown, 2 if t % 3 == 1 else 1)
            segments: list = []
            for _ in range(take):
                shown += 1
                path = os.path.join(root, f"{d}-{shown}.png")
                PILImage.new("RGB", (64 + 8 * (shown % 4), 64), colours[(d + shown) % len(colours)]).save(path)
                segments += [f"Image{shown}: ", Image(path), "\n"]
            if take:
                question = f"Describe Image{shown} in detail: colours, objects and layout."
            else:
                a, b = rng.randint(1, max(shown, 1)), rng.randint(1, max(shown, 1))
                question = f"How does Image{a} differ from Image{b}? Answer step by step." + " Be specific." * rng.randint(0, 3)
            out += [Turn("user", tuple(segments) + (question,)), Turn("assistant", ("reference",))]
        dialogues.append(Dialogue(f"bench-{d}", "bench", tuple(out)))
    return dialogues


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="paths", choices=["paths", "ranks", "api"],
                        help="what to measure (see above); default: the generator's paths")
    parser.add_argument("--dialogues", type=int, default=None, help="dialogues (default: 32; 64 for api)")
    parser.add_argument("--turns", type=int, default=10, help="mean turns per dialogue (each varies by up to 3)")
    parser.add_argument("--images", type=int, default=6, help="images per dialogue")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-sizes", default="4,8,16", help="batched KV path batch sizes (ranks: the first one)")
    parser.add_argument("--lockstep-batch", type=int, default=8,
                        help="batch of the lockstep schedule (rows start turns together; 0 = skip it)")
    parser.add_argument("--reencode-batch", type=int, default=8, help="batch of the re-encode path (0 = skip it)")
    parser.add_argument("--stop-scale", type=float, default=3.0, help="scale of the stop token's output row (1 = as built)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of torch; 1 because a model this small spends more time in thread handoffs than in math")
    parser.add_argument("--raw", action="store_true", help="let the random model emit partial UTF-8 byte tokens")
    parser.add_argument("--ranks", type=int, default=2, help="ranks: processes of the data-parallel run")
    parser.add_argument("--latency", type=float, default=0.1, help="api: seconds the server takes per request")
    parser.add_argument("--concurrency", type=int, default=16, help="api: dialogues in flight")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # ranks: a rank's report file (internal)
    parser.add_argument("--image-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args):
    """The bench's random LLaVA, its dialogues, a factory of generators that answer like a trained
    model, and the token ids it bans to that end."""
    import torch

    from mmtune.evaluation.config import GenerationConfig
    from mmtune.evaluation.generation.generator import DialogueGenerator
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    adapter = build_adapter(ModelConfig(family="llava", architecture=BENCH_ARCHITECTURE))
    model = adapter.load_model(seed=0).to(args.device)
    with torch.no_grad():
        model.get_output_embeddings().weight[adapter.stop_token_ids[0]] *= args.stop_scale
    dialogues = build_dialogues(args.dialogues, args.turns, args.images, args.image_dir or tempfile.mkdtemp())

    tok = adapter.tokenizer
    banned, spaced = [], None
    if not args.raw:
        texts = [tok.decode([i]) for i in range(len(tok))]
        banned = [i for i, text in enumerate(texts) if "\ufffd" in text]
        spaced = torch.tensor([text.startswith(" ") and i not in banned for i, text in enumerate(texts)])

    class WellFormed:
        """Mimic a trained model's text: the first answer token starts with a space, and
        every prefix of the answer is the tokenizer's own (canonical) tokenization of its
        text, so the answer re-tokenizes to the ids that were generated. Greedy choice
        among the 32 best tokens that keep both properties."""

        def __init__(self):
            self.start = None

        def __call__(self, input_ids, scores):
            if self.start is None:
                self.start = input_ids.shape[1]
            out = torch.full_like(scores, float("-inf"))
            for row in range(scores.shape[0]):
                generated = input_ids[row, self.start :].tolist()
                for cand in scores[row].topk(32).indices.tolist():
                    if cand in adapter.stop_token_ids:
                        ok = True
                    elif not generated and not spaced[cand]:
                        ok = False
                    else:
                        ids = generated + [cand]
                        ok = cand not in banned and tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids
                    if ok:
                        out[row, cand] = scores[row, cand]
                        break
                else:
                    out[row] = scores[row]
            return out

    def make(kv: bool, batch: int, lockstep: bool = False) -> DialogueGenerator:
        gen = DialogueGenerator(adapter, model, GenerationConfig(
            max_new_tokens=args.max_new_tokens, kv_reuse=kv, batch_size=batch,
            batch_schedule="lockstep" if lockstep else "continuous"))
        if banned:
            from transformers import SuppressTokensLogitsProcessor

            base = gen._logits_processors

            def with_ban():
                processors = base()
                processors.append(SuppressTokensLogitsProcessor(banned, device=args.device))
                processors.append(WellFormed())
                return processors

            gen._logits_processors = with_ban
        return gen

    return adapter, model, dialogues, make, banned


def main() -> None:
    args = parse_args()
    if args.dialogues is None:
        args.dialogues = {"paths": 32, "ranks": 32, "api": 64}[args.part]
    if args.worker:
        return rank_worker(args)
    if args.part == "ranks":
        return bench_ranks(args)
    if args.part == "api":
        return bench_api(args)
    adapter, model, dialogues, make, banned = build_model(args)
    paths = [("KV", True, 1)] + [("KV", True, int(b)) for b in args.batch_sizes.split(",") if b]
    if args.lockstep_batch:
        paths.append(("KV lockstep", True, args.lockstep_batch))
    if args.reencode_batch:
        paths.append(("re-encode", False, args.reencode_batch))
    runs = []
    for name, kv, batch in paths:
        gen = make(kv, batch, lockstep=name == "KV lockstep")
        start = time.perf_counter()
        records = gen.generate(dialogues)
        runs.append((name, batch, records, dict(gen.stats), time.perf_counter() - start))

    _, _, base_records, base_stats, base_time = runs[0]
    length = 0
    for d in dialogues:
        last = [r for r in base_records if r.dialogue_id == d.id][-1]
        length += last.prompt_tokens + last.new_tokens
    turns = [sum(1 for _ in d.exchanges()) for d in dialogues]
    answer_lengths = [r.new_tokens for r in base_records]
    stops = sum(r.finish_reason == "stop" for r in base_records)
    params = sum(p.numel() for p in model.parameters())
    print(f"{len(dialogues)} dialogues, {sum(turns)} turns ({min(turns)}-{max(turns)} per dialogue), "
          f"{args.images} images each ({adapter.num_image_tokens} tokens/image); random LLaVA {params / 1e6:.1f}M params, "
          f"fp32, {args.device}")
    print(f"answers: max_new_tokens={args.max_new_tokens}, mean {sum(answer_lengths) / len(answer_lengths):.1f} tokens, "
          f"{stops}/{len(answer_lengths)} ended by the stop token; "
          f"{'raw random model' if args.raw else f'well-formed text ({len(banned)} partial-byte tokens banned)'}")
    print(f"dialogue length (sum of final sequences): {length:,} tokens")
    print()
    header = (f"{'path':<12} {'B':>3} {'fwd calls':>10} {'vs B=1':>7} {'real tok':>9} {'real/len':>9} "
              f"{'pad tok':>8} {'pad/real':>9} {'idle':>7} {'compact':>8} {'wall s':>8} {'speedup':>8}  same answers")
    print(header)
    print("-" * len(header))
    for name, batch, records, stats, wall in runs:
        same = [r.answer for r in records] == [r.answer for r in base_records]
        real, pad = stats["forward_tokens"], stats["padding_tokens"]
        print(f"{name:<12} {batch:>3} {stats['forward_calls']:>10,} {stats['forward_calls'] / base_stats['forward_calls']:>7.3f} "
              f"{real:>9,} {real / length:>9.3f} {pad:>8,} {pad / real:>9.3f} {stats['idle_tokens']:>7,} {stats['compactions']:>8} "
              f"{wall:>8.1f} {base_time / wall:>7.2f}x  {same}")
    print()
    for name, batch, _, stats, _ in runs:
        if name == "KV" and batch == 8:
            ratio = stats["forward_calls"] / base_stats["forward_calls"]
            print(f"goal: KV B=8 forward calls <= 1/6 of batch-1's: {ratio:.3f} -> {'met' if ratio <= 1 / 6 else 'NOT met'}")
            real = stats["forward_tokens"] / length
            print(f"goal: KV B=8 real tokens <= 1.1x dialogue length: {real:.3f} -> {'met' if real <= 1.1 else 'NOT met'}")


# ---------------------------------------------------------------------------- data-parallel ranks


def rank_worker(args) -> None:
    """One rank of ``--part ranks`` (or the one process): answer the dialogues through
    :func:`generate_shared`, write this run's wall time and each rank's work (rank 0)."""
    from mmtune.evaluation.generation.data_parallel import current_layout, generate_shared

    layout = current_layout()
    _, _, dialogues, make, _ = build_model(args)
    generator = make(True, int(args.batch_sizes.split(",")[0]), lockstep=True)
    layout.barrier()  # every rank has built its model: what follows is generation alone
    start = time.perf_counter()
    records, ranks = generate_shared(generator, dialogues, Path(args.out_dir) / "bench.jsonl", layout=layout,
                                     run_key={"checkpoint": "bench", "data": "bench", "about": {"run": "bench"}})
    wall = time.perf_counter() - start
    if ranks is None:  # one process: its own work
        ranks = [{"rank": 0, "dialogues": len(dialogues), "seconds": round(wall, 3),
                  "expected_tokens": sum(generator.expected_tokens(d) for d in dialogues), **generator.stats}]
    if layout.is_main:
        Path(args.worker).write_text(json.dumps({"wall": wall, "ranks": ranks, "turns": len(records)}))


def bench_ranks(args) -> None:
    """1 process vs ``--ranks`` processes on the same dialogues, side by side."""
    root = Path(tempfile.mkdtemp())
    (root / "images").mkdir()
    base = sys.argv[1:]
    runs = []
    for n in (1, args.ranks):
        out = root / f"out{n}"
        report = root / f"report{n}.json"
        worker = [str(Path(__file__).resolve()), *base, "--worker", str(report), "--image-dir", str(root / "images"),
                  "--out-dir", str(out), "--dialogues", str(args.dialogues)]
        if n == 1:
            cmd = [sys.executable, *worker]
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                   str(port), *worker]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{n} process(es) failed:\n{proc.stderr[-3000:]}")
        runs.append((n, total, json.loads(report.read_text()), (out / "bench.jsonl").read_bytes()))

    cores = os.cpu_count()
    print(f"{args.dialogues} dialogues, {runs[0][2]['turns']} turns; random LLaVA (bench model), fp32, "
          f"{args.threads} CPU thread(s) per process, {cores} cores on this machine; KV path, lockstep, "
          f"B={args.batch_sizes.split(',')[0]} per rank")
    print()
    header = (f"{'procs':>5} {'gen wall s':>10} {'speedup':>8} {'with start-up s':>16} | {'rank':>4} {'dialogues':>9} "
              f"{'turns':>6} {'exp. tokens':>11} {'fwd calls':>9} {'real tok':>9} {'pad tok':>8} {'rank s':>7}")
    print(header)
    print("-" * len(header))
    base_wall = runs[0][2]["wall"]
    for n, total, report, _ in runs:
        for i, w in enumerate(report["ranks"]):
            lead = (f"{n:>5} {report['wall']:>10.1f} {base_wall / report['wall']:>7.2f}x {total:>16.1f}" if i == 0
                    else " " * 42)
            print(f"{lead} | {w['rank']:>4} {w['dialogues']:>9} {w.get('turns', 0):>6} {w.get('expected_tokens', 0):>11,} "
                  f"{w.get('forward_calls', 0):>9,} {w.get('forward_tokens', 0):>9,} {w.get('padding_tokens', 0):>8,} "
                  f"{w['seconds']:>7.1f}")
    print()
    same = all(r[3] == runs[0][3] for r in runs)
    print(f"gathered generations file equals the one-process file byte for byte: {same}")
    ranks = runs[-1][2]["ranks"]
    spread = max(w["seconds"] for w in ranks) / max(min(w["seconds"] for w in ranks), 1e-9)
    shares = ", ".join(f"{w['expected_tokens']:,}" for w in ranks)
    print(f"{args.ranks} ranks: slowest / fastest rank {spread:.2f}; expected tokens per rank {shares}")


# ---------------------------------------------------------------------------- a served model


def bench_api(args) -> None:
    """The api backend against a loopback server with a fixed latency: wall vs the ideal."""
    from mmtune.evaluation.config import ApiGenerationConfig, GenerationConfig
    from mmtune.evaluation.generation.api import ApiGenerator
    from tests.support.fake_judge import FakeJudgeServer, Scripted

    dialogues = build_dialogues(args.dialogues, args.turns, args.images, tempfile.mkdtemp())
    turns = [len(list(d.exchanges())) for d in dialogues]
    counter = iter(range(10**9))
    reply = lambda body: Scripted(f"answer {next(counter)}", delay_s=args.latency)  # noqa: E731
    with FakeJudgeServer(reply, max_requests=sum(turns) + turns[0], lifetime_s=600) as server:
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, backend="api",
                               api=ApiGenerationConfig(model="bench-served", concurrency=args.concurrency))
        generator = ApiGenerator(cfg, env={"MMTUNE_GEN_BASE_URL": server.base_url})
        generator.generate(dialogues[:1])  # connection set-up is not part of the figure
        warm = len(server.requests)
        start = time.perf_counter()
        records = generator.generate(dialogues)
        wall = time.perf_counter() - start
        sizes = [len(json.dumps(body)) for body in server.requests[warm:]]
        generator.close()
    ideal = max(sum(turns) / args.concurrency, max(turns)) * args.latency
    print(f"{len(dialogues)} dialogues, {sum(turns)} turns ({min(turns)}-{max(turns)} per dialogue), {args.images} images "
          f"each (data URLs, every image so far in each request: {sum(sizes) / len(sizes) / 1e3:.1f} kB per request on "
          f"average); latency {args.latency * 1000:.0f} ms, concurrency {args.concurrency}")
    print(f"wall {wall:.3f}s vs ideal {ideal:.3f}s -> ratio {wall / ideal:.3f} (goal <= 1.2)")
    print(f"requests {len(server.requests) - warm}, max in flight at the server {server.max_in_flight}; "
          f"all answered: {all(r.answer for r in records)}; failed: {generator.usage()['failed']}")


if __name__ == "__main__":
    main()
