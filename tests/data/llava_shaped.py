"""A small file shaped like ``llava_v1_5_mix665k.json``, ids repeated as the real file repeats them.

The real file names a COCO record by its image's number, and several sub-sets ask about the
same COCO images (LLaVA-Instruct's conversation, detail and complex-reasoning sets, VQAv2,
OK-VQA, A-OKVQA, RefCOCO), so one id names several records with different conversations,
far apart in the file. GQA, OCR-VQA, TextVQA and VG records, and the text-only ShareGPT
records, are written here with ids of their own. One record is written twice, unchanged
(an exact duplicate).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image as PILImage

COCO_IDS = ["000000033471", "000000052846", "000000334872", "000000319154"]

# sub-set -> (first question, answer, more turns) per COCO image: every sub-set asks about every image.
_COCO_SETS = {
    "conversation": ("<image>\nWhat is in the picture?", "A {c} square.", [("Is it large?", "Fairly.")]),
    "detail": ("Describe the image in detail.\n<image>", "The image shows a {c} square on a plain ground.", []),
    "reasoning": ("<image>\nWhy might someone take this photo?", "To show the {c} square.", []),
    "vqav2": ("<image>\nWhat colour is it?\nAnswer the question using a single word or phrase.", "{c}",
              [("Is there a square?", "Yes")]),
    "okvqa": ("<image>\nWhat shape is shown?", "square", []),
}


def _conversation(question: str, answer: str, more: list[tuple[str, str]]) -> list[dict]:
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    for q, a in more:
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return turns


def write_llava_shaped(root: Path, image_size: int = 16) -> tuple[Path, list[dict]]:
    """``root/llava_v1_5_mix665k.json`` and its images under ``root`` (coco/train2017/..., gqa/images/...);
    returns the file and its records (28: 20 COCO records over 4 ids, 1 exact duplicate, 7 others)."""
    colours = ["red", "green", "blue", "white"]
    records: list[dict] = []
    for name, (question, answer, more) in _COCO_SETS.items():  # sub-set by sub-set, as the real file groups them
        for image_id, colour in zip(COCO_IDS, colours):
            records.append({"id": image_id, "image": f"coco/train2017/{image_id}.jpg",
                            "conversations": _conversation(question, answer.format(c=colour), more)})
    records.append(dict(records[0]))  # the same record again: an exact duplicate
    for n, folder in enumerate(["gqa/images", "ocr_vqa/images", "textvqa/train_images", "vg/VG_100K"]):
        records.append({"id": f"{folder.split('/')[0]}-{n}", "image": f"{folder}/{n}.jpg",
                        "conversations": _conversation("<image>\nWhat colour?", colours[n], [])})
    for n in range(3):
        records.append({"id": f"i6IyJda_{n}", "conversations": _conversation(f"Tell me fact {n}.", f"Fact {n}.", [])})
    for record in records:
        if "image" in record and not (root / record["image"]).exists():
            (root / record["image"]).parent.mkdir(parents=True, exist_ok=True)
            colour = colours[COCO_IDS.index(record["id"])] if record["id"] in COCO_IDS else "gray"
            PILImage.new("RGB", (image_size, image_size), colour).save(root / record["image"])
    path = root / "llava_v1_5_mix665k.json"
    path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    return path, records
