"""Forward tokens per dialogue: KV-cache reuse across turns vs re-encoding the history.

    python bench/eval_generation.py [--dialogues 3] [--turns 15] [--images 10] [--max-new-tokens 32]

A tiny random-weight LLaVA answers 15-turn dialogues that introduce 10 images (one in
each of the first 10 turns). "dialogue length" is the final sequence (last prompt + last
answer). Re-encoding runs every prompt again, about T/2 times the dialogue length; the
KV path runs each token about once, plus the answer tokens whose re-tokenized text
differs from the generated ids. Random weights emit byte-level tokens that are not
valid UTF-8 on their own; they decode to U+FFFD and re-tokenize differently, so the
cache is cropped back before them every turn; and their first answer token often lacks
the separator space the template puts before an answer, so the whole answer
re-tokenizes differently. By default the bench mimics a trained model's well-formed
answers (no partial-byte tokens, the first token starts with a space as LLaVA answers
do, canonical tokenization); ``--raw`` shows the random model as it is. Answers of both paths are compared too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dialogues", type=int, default=3)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--images", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--raw", action="store_true", help="let the random model emit partial UTF-8 byte tokens")
    args = parser.parse_args()

    import torch
    from PIL import Image as PILImage

    from mmtune.data.dialogue import Dialogue, Image, Turn
    from mmtune.evaluation.config import GenerationConfig
    from mmtune.evaluation.generation import DialogueGenerator
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    torch.manual_seed(0)
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0).to(args.device)
    tmp = tempfile.mkdtemp()
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "cyan", "magenta", "gray", "brown"]
    dialogues = []
    for d in range(args.dialogues):
        turns = []
        for t in range(args.turns):
            if t < args.images:
                path = os.path.join(tmp, f"{d}-{t}.png")
                PILImage.new("RGB", (56, 56), colours[(d + t) % len(colours)]).save(path)
                segments = (f"Image{t + 1}: ", Image(path), f". What colour is Image{t + 1}?")
            else:
                segments = (f"Compare Image{t - args.images + 1} with Image{args.images}.",)
            turns += [Turn("user", segments), Turn("assistant", ("reference",))]
        dialogues.append(Dialogue(f"bench-{d}", "bench", tuple(turns)))

    banned, spaced = [], None
    if not args.raw:
        tok = adapter.tokenizer
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

    def make(kv: bool) -> DialogueGenerator:
        gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=args.max_new_tokens, kv_reuse=kv))
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

    rows = {}
    for kv in (True, False):
        gen = make(kv)
        start = time.perf_counter()
        records = gen.generate(dialogues)
        rows[kv] = (records, time.perf_counter() - start)

    kv_records, kv_time = rows[True]
    re_records, re_time = rows[False]
    same = [r.answer for r in kv_records] == [r.answer for r in re_records]
    print(f"{args.dialogues} dialogues x {args.turns} turns, {args.images} images each "
          f"({adapter.num_image_tokens} tokens/image), max_new_tokens={args.max_new_tokens}, "
          f"{'raw random model' if args.raw else f'well-formed text ({len(banned)} partial-byte tokens banned)'}")
    print(f"{'dialogue':<10} {'length':>7} {'KV fwd':>8} {'KV/len':>7} {'re-enc fwd':>11} {'re/len':>7} {'T/2':>5}")
    for d in dialogues:
        kv_d = [r for r in kv_records if r.dialogue_id == d.id]
        re_d = [r for r in re_records if r.dialogue_id == d.id]
        length = kv_d[-1].prompt_tokens + kv_d[-1].new_tokens
        kv_fwd = sum(r.forward_tokens for r in kv_d)
        re_fwd = sum(r.forward_tokens for r in re_d)
        print(f"{d.id:<10} {length:>7} {kv_fwd:>8} {kv_fwd / length:>7.2f} {re_fwd:>11} {re_fwd / length:>7.2f} {args.turns / 2:>5.1f}")
    print("first answers:", [r.answer[:40] for r in kv_records[:3]])
    print(f"wall time: KV reuse {kv_time:.2f}s, re-encode {re_time:.2f}s; answers identical: {same}")


if __name__ == "__main__":
    main()
