"""Working memory and time of the loss alone (forward + backward): linear cross-entropy vs materialised logits.

    python bench/loss_memory.py                                   # 2k and 8k tokens, vocab 32,064 and 92,544
    python bench/loss_memory.py --tokens 2048 8192 --vocabs 32064 --repeats 3   # what a small CPU box can run
    python bench/loss_memory.py --hidden 256 --max-case-seconds 120             # a quick look

For every (tokens, vocabulary) pair the same inputs go through each loss path, each run
in a fresh process so one case's allocator state cannot flatter the next; the paths take
turns ``--repeats`` times (materialised, chunked, ..., materialised, chunked, ...) so a
change in machine load hits them alike, and the table shows medians:

* inputs: final hidden states ``[tokens, hidden]`` and a trainable output weight
  ``[vocab, hidden]``, fp32 on CPU, bf16 hidden + fp32 weight under bf16 autocast on GPU;
  by default every position has a label (the worst case for the chunked path, which
  skips ignored rows; ``--label-fraction`` sets the share);
* measured: peak memory above what the process held with the inputs allocated (CPU:
  resident set size sampled every 2 ms; GPU: ``torch.cuda.max_memory_allocated``), the
  wall time of the forward pass plus ``loss.backward()`` and, on CPU, the CPU seconds
  its threads spent (on a machine other jobs share, wall time swings with their load;
  CPU time much less, so "cpu vs mat" is the steadier ratio there).

On CPU in fp32 the chunked loss multiplies with oneDNN's kernel (PyTorch's matmul is MKL's
sgemm, which runs its AVX2 code on AMD processors), while the materialised path is the
model's ``lm_head``, torch's matmul. So that the table tells the GEMM from the algorithm, a
third row, ``mat-onednn``, runs the materialised path on oneDNN's kernel, and a line after
each case compares the chunked path with it.

Every path must hand back the two gradients (``hidden.grad`` and ``weight.grad``, the
"grads" column); the "working" column is the peak minus them, what the loss itself
holds (logits, their softmax and gradient, chunk buffers). Ratios are against the
materialised path on the same inputs. Materialised cases whose logits cannot fit in the
memory this machine has free are skipped and say so; so are cases whose estimated run
time exceeds ``--max-case-seconds`` (the estimate uses this machine's measured matmul
speed: every path runs three ``tokens x hidden x vocab`` matmuls).

Goal at 8k tokens, every position labelled, hidden 4096: chunked working set <= 10% of
the materialised one, time <= 0.95x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

GiB = 1024**3
MATERIALIZED_ONEDNN = "mat-onednn"


def _case(tokens: int, vocab: int, hidden: int, impl: str, chunk_size: int, device: str,
          label_fraction: float) -> dict:
    """Run one case in this process and return its measurements."""
    import psutil
    import torch
    import torch.nn.functional as F

    from mmtune.training.loss import _liger_sum, chunked_linear_cross_entropy, shifted_targets

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden_states = (torch.randn(tokens, hidden, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    # The first (1 - label_fraction) of the row is prompt/image tokens, as in a dialogue.
    labels[:, : int(tokens * (1 - label_fraction))] = -100
    targets = shifted_targets(labels).reshape(-1)

    def run():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            if impl == "materialized":
                logits = hidden_states @ weight.t() if device == "cpu" else F.linear(hidden_states, weight)
                loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
            elif impl == MATERIALIZED_ONEDNN:
                logits = _one_dnn_linear_function().apply(hidden_states, weight)
                loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            elif impl == "chunked":
                loss = chunked_linear_cross_entropy(hidden_states, weight, targets, chunk_size=chunk_size)
            else:
                loss = _liger_sum(hidden_states, weight, None, targets)
        loss.backward()
        return loss.detach()

    grads_bytes = hidden_states.numel() * hidden_states.element_size() + weight.numel() * 4
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        loss = run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        extra = torch.cuda.max_memory_allocated() - base
    else:
        process = psutil.Process()
        base = process.memory_info().rss
        peak = [base]
        stop = threading.Event()

        sampler_cpu = [0.0]

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.002)
            sampler_cpu[0] = time.thread_time()

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = run()
        seconds = time.perf_counter() - started
        stop.set()
        thread.join()
        # CPU seconds of the loss's own threads (the sampler's excluded): what a busy machine inflates least.
        cpu = time.process_time() - cpu_started - sampler_cpu[0]
        peak[0] = max(peak[0], process.memory_info().rss)
        extra = peak[0] - base
    return {"extra": extra, "grads": grads_bytes, "working": max(extra - grads_bytes, 0), "seconds": seconds,
            "cpu_seconds": cpu if device == "cpu" else None, "loss": float(loss)}


def _one_dnn_linear_function():
    """``hidden @ weight.T`` with oneDNN's kernel forward and backward: the materialised path on the chunked one's GEMM."""
    import torch

    from mmtune.training.loss import _onednn_linear

    linear = _onednn_linear()

    class OneDnnLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight):
            ctx.save_for_backward(hidden, weight)
            return linear(hidden, weight)

        @staticmethod
        def backward(ctx, grad):
            hidden, weight = ctx.saved_tensors
            return linear(grad, weight.t()), linear(grad.t(), hidden.t())

    return OneDnnLinear


def _matmul_gflops(device: str) -> float:
    import torch

    a = torch.randn(1024, 2048, device=device)
    b = torch.randn(2048, 4096, device=device)
    a @ b
    started = time.perf_counter()
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 3 * 2 * 1024 * 2048 * 4096 / (time.perf_counter() - started) / 1e9


def _free_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    import psutil

    return psutil.virtual_memory().available


def _skip_reason(tokens, vocab, hidden, impl, chunk_size, device, gflops, args) -> str | None:
    logits_bytes = tokens * vocab * 4
    inputs = (tokens + 2 * vocab) * hidden * 4 + tokens * hidden * 4  # inputs + gradients
    if impl in ("materialized", MATERIALIZED_ONEDNN):
        need = 3 * logits_bytes + inputs  # logits, log-softmax and the logits' gradient
    else:
        need = 2 * min(tokens, chunk_size) * vocab * 4 + inputs
    free = _free_bytes(device)
    if need > args.memory_fraction * free:
        return f"skipped: needs ~{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
    estimate = 3 * 2 * tokens * vocab * hidden / (gflops * 1e9)  # logits, hidden gradient, weight gradient
    if estimate > args.max_case_seconds:
        return f"skipped: ~{estimate:.0f} s estimated > --max-case-seconds {args.max_case_seconds:g}"
    return None


def _run_case(tokens, vocab, impl, device, args, env) -> dict:
    cmd = [sys.executable, __file__, "--case", str(tokens), str(vocab), str(args.hidden), impl,
           "--chunk-size", str(args.chunk_size), "--device", device, "--label-fraction", str(args.label_fraction)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32064, 92544])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--label-fraction", type=float, default=1.0,
                        help="share of positions with a label (1.0: every position, the chunked path's worst case)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per path and case, taking turns (median shown)")
    parser.add_argument("--max-case-seconds", type=float, default=600.0)
    parser.add_argument("--memory-fraction", type=float, default=0.6,
                        help="run a case only if its estimated need is below this share of free memory")
    parser.add_argument("--case", nargs=4, metavar=("TOKENS", "VOCAB", "HIDDEN", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.case:
        tokens, vocab, hidden, impl = int(args.case[0]), int(args.case[1]), int(args.case[2]), args.case[3]
        print(json.dumps(_case(tokens, vocab, hidden, impl, args.chunk_size, device, args.label_fraction)))
        return

    from mmtune.training.loss import _onednn_linear, fused_available

    # On CPU in fp32 the chunked loss multiplies with oneDNN's kernel where PyTorch has it, the
    # materialised path (the model's lm_head) with torch's matmul; the extra row runs the
    # materialised path on oneDNN's kernel too, so the table separates the GEMM from the algorithm.
    same_gemm = device == "cpu" and _onednn_linear() is not None
    impls = (["materialized", "chunked"] + ([MATERIALIZED_ONEDNN] if same_gemm else [])
             + (["fused"] if device == "cuda" and fused_available() else []))
    gflops = _matmul_gflops(device)
    print(f"device {device}, {torch.get_num_threads()} threads, matmul ~{gflops:.0f} GFLOP/s; hidden {args.hidden}, "
          f"chunk {args.chunk_size} rows, {'bf16 autocast' if device == 'cuda' else 'fp32'}, "
          f"{args.label_fraction:.0%} of positions labelled; "
          f"memory = {'max_memory_allocated' if device == 'cuda' else 'peak RSS'} above the inputs")
    header = (f"{'tokens':>6} {'vocab':>6} {'path':>12} {'grads GiB':>9} {'working GiB':>11} {'time s':>7} "
              f"{'cpu s':>7} {'working vs mat':>14} {'time vs mat':>11} {'cpu vs mat':>10}")
    print(header)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for tokens in args.tokens:
        for vocab in args.vocabs:
            runs: dict[str, list[dict]] = {}
            for impl in impls:
                reason = _skip_reason(tokens, vocab, args.hidden, impl, args.chunk_size, device, gflops, args)
                if reason:
                    print(f"{tokens:>6} {vocab:>6} {impl:>12}  {reason}", flush=True)
                else:
                    runs[impl] = []
            for _ in range(args.repeats):
                for impl in runs:  # the paths take turns, so a change in machine load hits them alike
                    runs[impl].append(_run_case(tokens, vocab, impl, device, args, env))
            reference = None
            summaries: dict[str, dict] = {}
            for impl, results in runs.items():
                failed = [r["failed"] for r in results if "failed" in r]
                if failed:
                    print(f"{tokens:>6} {vocab:>6} {impl:>12}  failed: {failed[0]}", flush=True)
                    continue
                r = {key: statistics.median(x[key] for x in results) for key in ("grads", "working", "seconds")}
                cpu = [x["cpu_seconds"] for x in results if x.get("cpu_seconds") is not None]
                r["cpu"] = statistics.median(cpu) if cpu else None
                r["loss"] = results[0]["loss"]
                times = " ".join(f"{x['seconds']:.1f}" for x in results)
                line = (f"{tokens:>6} {vocab:>6} {impl:>12} {r['grads'] / GiB:>9.3f} {r['working'] / GiB:>11.3f} "
                        f"{r['seconds']:>7.2f} {r['cpu'] or float('nan'):>7.1f}")
                if impl == "materialized":
                    reference = r
                    line += f" {'':>14} {'':>11} {'':>10}"
                elif reference is not None:
                    cpu_ratio = r["cpu"] / reference["cpu"] if r["cpu"] and reference["cpu"] else float("nan")
                    line += (f" {r['working'] / max(reference['working'], 1):>13.1%} "
                             f"{r['seconds'] / reference['seconds']:>10.2f}x {cpu_ratio:>9.2f}x")
                    if abs(r["loss"] - reference["loss"]) > 1e-3 * abs(reference["loss"]):
                        line += f"  LOSS MISMATCH {r['loss']:.4f} vs {reference['loss']:.4f}"
                print(line + f"  (wall s per run: {times})", flush=True)
                summaries[impl] = r
            if "chunked" in summaries and MATERIALIZED_ONEDNN in summaries:
                a, b = summaries["chunked"], summaries[MATERIALIZED_ONEDNN]
                cpu = f", cpu {a['cpu'] / b['cpu']:.2f}x" if a["cpu"] and b["cpu"] else ""
                print(f"{tokens:>6} {vocab:>6}  chunked vs {MATERIALIZED_ONEDNN} (the same GEMM): "
                      f"time {a['seconds'] / b['seconds']:.2f}x{cpu}, "
                      f"working {a['working'] / max(b['working'], 1):.1%}", flush=True)

if __name__ == "__main__":
    main()
