"""How exactly a packed M-RoPE row equals its samples run alone: the measured differences.

    OMP_NUM_THREADS=1 python bench/packing_mrope.py

For each Qwen-VL class (tiny random weights, fp32, CPU) and attention kernel, one packed batch
of two rows (six samples with 0, 1 and 2 images of different grids, a 1-token sample and the
row padding; the samples of ``tests/data/test_packing_mrope.py``) against each sample alone:
the largest absolute difference of the token-mean loss, of any gradient of it and of any
logit, on transformers' block-mask path and on mmtune's per-sample attention. The test asserts
each is at most 1e-5; this prints what they are.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the samples and helpers are the test's: make the repository root importable so `tests` resolves
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from PIL import Image as PILImage

    from mmtune.models.qwen2_vl import MODEL_TYPES
    from mmtune.training.packed_attention import PACKED_IMPLEMENTATIONS, language_model, use_attention
    from tests.data.test_packing_mrope import ROWS, _adapter, _dataset, _examples, _loss_and_grads, _packed

    root = Path(tempfile.mkdtemp(prefix="mmtune-pack-"))
    paths = []
    for k, size in enumerate([(80, 60), (40, 120), (30, 30), (200, 56)]):
        path = root / f"{k}.png"
        PILImage.effect_noise(size, 60).convert("RGB").save(path)
        paths.append(str(path))
    print("| class | attention | path | token-mean loss | gradients | logits |  (max abs diff, packed vs alone)")
    print("|---|---|---|---|---|---|")
    for model_type in MODEL_TYPES:
        for attn in ("sdpa", "eager"):
            adapter = _adapter(model_type)
            model = adapter.load_model(attn_implementation=attn).train()
            dataset = _dataset(adapter, paths)
            collate = dataset.collator()
            examples = _examples(dataset)
            packed = _packed(collate, examples)
            lm = language_model(model, adapter.text_config(model.config))
            block = _loss_and_grads(model, [packed])
            with use_attention(lm, PACKED_IMPLEMENTATIONS[attn]):
                per_sample = _loss_and_grads(model, [packed])
            alone = _loss_and_grads(model, [collate([e]) for e in examples])
            for name, (loss, grads, logits) in (("block mask", block), ("per-sample", per_sample)):
                grad = max((grads[k] - alone[1][k]).abs().max().item() for k in alone[1])
                starts, logit = {0: 0, 1: 0}, 0.0
                for example, row, own in zip(examples, ROWS, alone[2]):
                    n = len(example)
                    logit = max(logit, (logits[0][row, starts[row]:starts[row] + n] - own[0]).abs().max().item())
                    starts[row] += n
                print(f"| {model_type} | {attn} | {name} | {abs(loss - alone[0]):.1e} | {grad:.1e} | {logit:.1e} |")


if __name__ == "__main__":
    main()
