"""Compare mmtune's native InternLM-XComposer2 with the official remote-code model.

Needs a GPU node that can run the official code (``trust_remote_code``) and a local copy
of an official checkpoint. It checks, in order:

1. tokenizer: mmtune's tokenizer (loaded without remote code) gives the official
   tokenizer's ids on a few strings in the chat format;
2. text logits: the same ``input_ids`` through both models;
3. image features: ``vit`` + ``vision_proj`` on the same preprocessed image;
4. interleaved logits: text + image + text, the official model fed ``inputs_embeds`` and
   ``im_mask`` (its Partial LoRA path), mmtune fed ``input_ids`` with image tokens.

Usage::

    python scripts/xc2_parity.py --path /checkpoints/internlm-xcomposer2-vl-7b --image-size 490 \
        --image some.jpg [--dtype bfloat16]

Prints the largest absolute difference of each comparison and exits non-zero when one
exceeds ``--atol`` (exit 2 when a stage could not run because the official API differs
between revisions: reported as skipped with the error, never as passed).
"""

import argparse
import os
import sys

import torch


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="official checkpoint directory")
    parser.add_argument("--image-size", type=int, required=True, help="490 for -vl-7b, 224 for -7b")
    parser.add_argument("--image", required=True, help="an image file for the interleaved check")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--atol", type=float, default=5e-2, help="max |logit difference| accepted (bf16: ~5e-2)")
    args = parser.parse_args(argv)

    from transformers import AutoModel, AutoTokenizer

    from mmtune.data.dialogue import Dialogue, Turn
    from mmtune.models.config import ModelConfig
    from mmtune.models.internlm_xcomposer2 import InternLMXComposer2Adapter

    dtype = getattr(torch, args.dtype)
    device = "cuda"
    adapter = InternLMXComposer2Adapter(
        ModelConfig(family="internlm_xcomposer2", path=args.path, image_size=args.image_size, torch_dtype=args.dtype)
    )
    official_tok = AutoTokenizer.from_pretrained(args.path, trust_remote_code=True)
    failures, report, skipped = [], [], []

    # 1. tokenizer
    samples = [
        "user\nWhat is in Image1?",
        "assistant\nA red square on a white background.",
        "\n",
        "Image1: . Compare the two images, please.",
    ]
    for text in samples:
        ours = adapter.tokenizer(text, add_special_tokens=False)["input_ids"]
        theirs = official_tok(text, add_special_tokens=False)["input_ids"]
        ok = ours == theirs
        report.append(f"tokenizer {text!r}: {'same' if ok else f'DIFFERENT ours={ours} official={theirs}'}")
        if not ok:
            failures.append("tokenizer")

    native = adapter.load_model(torch_dtype=dtype, attn_implementation="sdpa").to(device).eval()
    official = AutoModel.from_pretrained(args.path, trust_remote_code=True, torch_dtype=dtype).to(device).eval()

    # 2. text-only logits
    dialogue = Dialogue("p", "parity", (Turn("user", ("Describe a sunny day in one sentence.",)),))
    encoded = adapter.encode_dialogue(dialogue, add_generation_prompt=True)
    ids = [i for chunk in encoded.prefix + [c for t in encoded.turns for c in t.chunks] + encoded.suffix for i in chunk.ids]
    input_ids = torch.tensor([ids], device=device)
    with torch.no_grad():
        a = native(input_ids=input_ids).logits
        b = official(input_ids=input_ids).logits
    diff = _max_diff(a, b)
    report.append(f"text logits: max |diff| = {diff:.4g}")
    if diff > args.atol:
        failures.append("text logits")

    # 3. image features and 4. interleaved logits
    pixels = adapter.preprocess_images([args.image]).to(device, dtype)
    try:
        with torch.no_grad():
            ours = native.get_image_features(pixels)
            theirs = official.img2emb(pixels)[0]
        diff = _max_diff(ours, theirs)
        report.append(f"image features: max |diff| = {diff:.4g}")
        if diff > args.atol:
            failures.append("image features")
        before = adapter.tokenizer("user\nImage1: ", add_special_tokens=False)["input_ids"]
        after = adapter.tokenizer(". What is shown?", add_special_tokens=False)["input_ids"]
        head = [adapter.tokenizer.bos_token_id, adapter.start_id] + before
        tail = after + [adapter.end_id]
        n = adapter.num_image_tokens
        ids = torch.tensor([head + [adapter.image_token_id] * n + tail], device=device)
        with torch.no_grad():
            a = native(input_ids=ids, pixel_values=pixels).logits
            embed = official.model.tok_embeddings
            embeds = torch.cat(
                [embed(torch.tensor([head], device=device)), theirs.to(dtype), embed(torch.tensor([tail], device=device))],
                dim=1,
            )
            im_mask = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=device)
            im_mask[0, len(head) : len(head) + n] = True
            b = official(inputs_embeds=embeds, im_mask=im_mask).logits
        diff = _max_diff(a, b)
        report.append(f"interleaved logits: max |diff| = {diff:.4g}")
        if diff > args.atol:
            failures.append("interleaved logits")
    except (AttributeError, TypeError) as err:
        report.append(f"image stages SKIPPED (official API differs: {type(err).__name__}: {err})")
        skipped.append("image stages")

    print("\n".join(report))
    if failures:
        print("FAILED: " + ", ".join(failures))
        return 1
    if skipped:
        print("INCOMPLETE: " + ", ".join(skipped) + " not compared")
        return 2
    print("parity OK")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
