"""Token-, pixel- and position-exact agreement of the qwen2_vl adapter with transformers.

For each of Qwen2-VL, Qwen2.5-VL and Qwen3-VL a tiny checkpoint directory is built locally
(its tokenizer, image processor and the released chat template). Generated native records
(llava, mmdu, xcomposer2 and messages formats; many image sizes and aspect ratios, tiny and
extreme ones, image modes and EXIF orientations, text-only turns, images in later turns,
system turns, odd whitespace) go through mmtune (reader -> Dialogue -> adapter -> encoder),
and are compared with a reference built here from the record itself, and with the model's
own transformers processor (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``) on
the same messages (ids, ``pixel_values``, ``image_grid_thw``, the
generation prompt):

- messages as the official Qwen fine-tuning code builds them (``_build_messages`` in QwenLM's
  ``qwen-vl-finetune/qwenvl/data/data_processor.py``: text split at the image placeholders,
  user parts stripped, empty parts dropped, assistant text verbatim);
- text = the checkpoint's chat template applied by the tokenizer (``apply_chat_template``);
- images decoded by transformers' ``load_image`` and run through the checkpoint's image
  processor (``pixel_values``, ``image_grid_thw``);
- each ``<|image_pad|>`` expanded as the processor documents it (``Qwen2VLProcessor.
  replace_image_token``): ``image_grid_thw[k].prod() // merge_size**2`` copies;
- ``input_ids`` = the tokenizer on the expanded text; position ids = the model's own
  ``get_rope_index`` on the whole sequence (a full model instance);
- labels by the official rule (``preprocess_qwen_visual``): after every ``<|im_start|>
  assistant``, from the second token after ``assistant`` through the next ``<|im_end|>`` and
  the token after it.
"""

import itertools
import json
import os
import random
import re

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Image
from mmtune.data.encoding import encode_example, flatten
from mmtune.data.readers import parse_record
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.qwen2_vl import MODEL_TYPES, model_classes
from mmtune.testing.qwen2_vl import save_tiny_checkpoint
from mmtune.models.registry import build_adapter

N_DIALOGUES = 36
PLACEHOLDERS = {"llava": "<image>", "mmdu": "<ImageHere>", "xcomposer2": "<ImageHere>"}
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "bot": "assistant",
         "system": "system"}  # fmt: skip

# (width, height, mode, EXIF orientation): tiny images (scaled up to min_pixels), extreme aspect
# ratios up to the processor's limit of 200, sizes above max_pixels (scaled down), odd modes.
IMAGE_SPECS = [
    (1, 1, "RGB", None), (3, 3, "RGB", None), (2, 300, "RGB", None), (300, 2, "L", None), (1, 200, "RGB", None),
    (13, 2600, "RGB", None), (28, 28, "RGB", None), (56, 56, "RGBA", None), (57, 113, "P", None),
    (640, 480, "RGB", None), (480, 640, "RGB", 6), (200, 90, "RGB", 8), (90, 200, "RGB", 3),
    (1000, 20, "CMYK", None), (33, 47, "LA", None), (120, 119, "RGB", None),
]  # fmt: skip

USER_TEXTS = [
    "What is shown?", "  Describe it.  ", "Compare {img} and {img} please.", "{img}\nWhat now?", "Look: {img}",
    "Is it raining? \n", "图里有什么？{img}", "a  b   c", "{img}{img} Two adjacent.", "Tabs\tand\nnewlines\n\n",
    " {img} , then text", "Ends with space ", "Image1: {img}\nImage2: {img}\nWhich is larger?",
    "Say assistant\nassistant", "{img}", "Numbers 1889 or 1907?",
]  # fmt: skip
ANSWERS = ["Yes.", " A red helmet.\n", "1. One\n2. Two", "\nStarts with a newline.", "\n\n  Two newlines.",
           "中文回答。", "ok ", "assistant\nhere", "  Leading spaces", "It is 42."]  # fmt: skip
SYSTEMS = ["You are a careful describer of images.", "Answer briefly.\n", " spaced system "]


def _images(root):
    rng = np.random.default_rng(0)
    paths = []
    for k, (width, height, mode, orientation) in enumerate(IMAGE_SPECS):
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        image = PILImage.fromarray(pixels, "RGBA")
        image = image.convert("P", palette=PILImage.Palette.ADAPTIVE) if mode == "P" else image.convert(mode)
        ext = "jpg" if mode in ("CMYK",) or orientation else "png"
        path = os.path.join(root, f"img{k}.{ext}")
        if orientation:
            exif = PILImage.Exif()
            exif[0x0112] = orientation
            image.save(path, exif=exif, quality=95)
        elif mode == "P":
            image.save(path, transparency=0)
        else:
            image.save(path)
        paths.append(f"img{k}.{ext}")
    return paths


def _records(names):
    """Native records of all four formats; ``{img}`` marks an image in a user text."""
    rng = random.Random(7)
    cycle = itertools.cycle(range(len(names)))  # every image file is used
    records = []
    for n in range(N_DIALOGUES):
        fmt = ["mmdu", "xcomposer2", "messages", "llava"][n % 4]
        turns = []
        if n % 3 == 0:
            turns.append(("system", rng.choice(SYSTEMS)))
        for k in range(rng.randint(1, 4)):
            text = rng.choice(USER_TEXTS)
            if fmt == "llava":  # llava-665k: one image, "<image>\n" at the start of a turn
                text = text.replace("{img}", "")
                if not any("{img}" in t for _, t in turns) and (k > 0 or n % 8 != 3):
                    text = "{img}\n" + text
            turns += [("user", text), ("assistant", rng.choice(ANSWERS))]
        images = [names[next(cycle)] for t in turns for _ in range(t[1].count("{img}"))]
        if fmt == "messages":
            messages = []
            for role, text in turns:
                if role != "user":
                    messages.append({"role": role, "content": text})
                    continue
                parts = []
                for k, piece in enumerate(text.split("{img}")):
                    if k:
                        path = images.pop(0)
                        parts.append({"type": "image_url", "image_url": {"url": path}} if k % 2 else
                                     {"type": "image", "image": path})  # fmt: skip
                    if piece:
                        parts.append({"type": "text", "text": piece})
                messages.append({"role": role, "content": parts})
            records.append(("messages", {"id": f"d{n}", "messages": messages}))
            continue
        placeholder = PLACEHOLDERS[fmt]
        roles = {"mmdu": ("user", "assistant"), "xcomposer2": ("human", "bot"), "llava": ("human", "gpt")}[fmt]
        conversations = [
            {"from": "system" if role == "system" else roles[role == "assistant"],
             "value": text.replace("{img}", placeholder)}
            for role, text in turns
        ]  # fmt: skip
        record = {"id": f"d{n}", "conversations": conversations}
        if images:
            record["image"] = images if fmt != "llava" else images[0]
        records.append((fmt, record))
    return records


def _official_messages(fmt, record, root):
    """The record as the official fine-tuning code's ``_build_messages`` builds the conversation."""
    from transformers.image_utils import load_image

    if fmt == "messages":
        out = []
        for message in record["messages"]:
            content = message["content"]
            if message["role"] != "user":
                out.append({"role": message["role"], "content": content if message["role"] == "system" else
                            [{"type": "text", "text": content}]})  # fmt: skip
                continue
            parts, text = [], ""
            for part in content + [None]:
                if part is None or part["type"] != "text":
                    if text.strip():
                        parts.append({"type": "text", "text": text.strip()})
                    text = ""
                    if part is not None:
                        url = part["image_url"]["url"] if part["type"] == "image_url" else part["image"]
                        parts.append({"type": "image", "image": os.path.join(root, url)})
                else:
                    text += part["text"]
            out.append({"role": "user", "content": parts})
    else:
        placeholder = PLACEHOLDERS[fmt]
        pool = record.get("image", [])
        pool = [pool] if isinstance(pool, str) else list(pool)
        out = []
        for turn in record["conversations"]:
            role = ROLES[turn["from"]]
            if role == "system":
                out.append({"role": "system", "content": turn["value"]})
            elif role == "assistant":
                out.append({"role": "assistant", "content": [{"type": "text", "text": turn["value"]}]})
            else:
                parts = []
                for seg in re.split(f"({re.escape(placeholder)})", turn["value"]):
                    if seg == placeholder:
                        parts.append({"type": "image", "image": os.path.join(root, pool.pop(0))})
                    elif seg.strip():
                        parts.append({"type": "text", "text": seg.strip()})
                out.append({"role": "user", "content": parts})
    images = [load_image(p["image"]) for m in out if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]  # fmt: skip
    return out, images


def _official_labels(ids, assistant_id, im_start, im_end):
    labels = [IGNORE_INDEX] * len(ids)
    for pos in range(1, len(ids)):
        if ids[pos] == assistant_id and ids[pos - 1] == im_start:
            start = end = pos + 2
            while end < len(ids) and ids[end] != im_end:
                end += 1
            labels[start : end + 2] = ids[start : end + 2]
    return labels


class Reference:
    """transformers' processing of one tiny checkpoint directory."""

    def __init__(self, directory):
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        with open(os.path.join(directory, "chat_template.json"), encoding="utf-8") as handle:
            self.template = json.load(handle)["chat_template"]
        self.processor = AutoImageProcessor.from_pretrained(directory, backend="pil")
        config = AutoConfig.from_pretrained(directory)
        generation_class = model_classes(config.model_type)
        self.model = generation_class._from_config(config).model  # the full model's own rope index
        self.config = config
        self.image_pad = "<|image_pad|>"
        self.image_id = self.tokenizer.convert_tokens_to_ids(self.image_pad)
        # the model's own processor class (Qwen2VLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor) over the
        # same tokenizer, image processor and template
        import transformers
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
        from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

        processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[config.model_type])
        video_class = getattr(transformers, VIDEO_PROCESSOR_MAPPING_NAMES[config.model_type]["torchvision"])
        self.full_processor = processor_class(image_processor=self.processor, tokenizer=self.tokenizer,
                                              video_processor=video_class(), chat_template=self.template)

    def processor_call(self, messages, images, add_generation_prompt=False):
        """``processor(text=processor.apply_chat_template(messages), images=images)``."""
        text = self.full_processor.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
        return self.full_processor(text=[text], images=images or None, return_tensors="pt")

    def encode(self, messages, images, add_generation_prompt=False):
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if images:
            pixels = self.processor(images=images, return_tensors="pt")
            grid = pixels["image_grid_thw"]
        else:
            pixels, grid = {"pixel_values": torch.zeros(0, 0)}, torch.zeros(0, 3, dtype=torch.long)
        merge = self.processor.merge_size
        parts = text.split(self.image_pad)
        assert len(parts) == len(grid) + 1
        expanded = parts[0] + "".join(self.image_pad * int(g.prod() // merge**2) + p for g, p in zip(grid, parts[1:]))
        ids = self.tokenizer(expanded)["input_ids"]
        ids_t = torch.tensor(ids)[None]
        mm_types = (ids_t == self.image_id).int()
        positions, _ = self.model.get_rope_index(
            ids_t, mm_token_type_ids=mm_types, image_grid_thw=grid if len(grid) else None
        )
        tok = self.tokenizer
        labels = _official_labels(ids, tok.convert_tokens_to_ids("assistant"), tok.convert_tokens_to_ids("<|im_start|>"),
                                  tok.convert_tokens_to_ids("<|im_end|>"))  # fmt: skip
        return ids, labels, pixels["pixel_values"], grid, positions[:, 0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qwen_images"))
    return root, _records(_images(root))


def _first_difference(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_dialogues_match_transformers(model_type, corpus, tmp_path):
    root, records = corpus
    directory = save_tiny_checkpoint(str(tmp_path / model_type), model_type, weights=False)
    adapter = build_adapter(ModelConfig(family="qwen2_vl", path=directory))
    reference = Reference(directory)
    assert reference.tokenizer.convert_ids_to_tokens(reference.tokenizer("assistant")["input_ids"]) == ["assistant"]
    identical, problems, image_counts = 0, [], []
    for fmt, record in records:
        dialogue = parse_record(fmt, record, image_root=root)
        messages, images = _official_messages(fmt, record, root)
        want_ids, want_labels, want_pixels, want_grid, want_positions = reference.encode(messages, images)
        example = encode_example(adapter, dialogue, max_length=None)
        inputs = adapter.image_inputs([ref.path for ref in example.images])
        positions = adapter.position_ids(torch.tensor(example.input_ids), inputs)
        image_counts.append(len(images))
        checks = {
            "input_ids": example.input_ids == want_ids,
            "labels": example.labels == want_labels,
            "image_grid_thw": torch.equal(inputs["image_grid_thw"], want_grid),
            # the grid read from the file header alone (no decode) is the processor's
            "header_grid": [list(adapter.image_grid(Image(ref.path))) for ref in example.images] == want_grid.tolist(),
            "pixel_values": (not images and inputs["pixel_values"].shape[0] == 0)
            or (inputs["pixel_values"].dtype == want_pixels.dtype and torch.equal(inputs["pixel_values"], want_pixels)),
            "position_ids": torch.equal(positions, want_positions),
        }
        # the same messages through the model's own transformers processor
        real = reference.processor_call(messages, images)
        checks["processor_input_ids"] = example.input_ids == real["input_ids"][0].tolist()
        checks["processor_image_inputs"] = (not images and "pixel_values" not in real) or (
            torch.equal(inputs["pixel_values"], real["pixel_values"])
            and torch.equal(inputs["image_grid_thw"], real["image_grid_thw"]))  # fmt: skip
        # generation: the dialogue up to its last user turn, with the generation prompt
        cut = max(i for i, t in enumerate(dialogue.turns) if t.role == "user")
        prompt_dialogue = type(dialogue)(dialogue.id, dialogue.source, dialogue.turns[: cut + 1])
        encoded = adapter.encode_dialogue(prompt_dialogue, add_generation_prompt=True)
        prompt_ids, _, _ = flatten(encoded, adapter.image_token_id)
        kept = sum(1 for m in messages[: cut + 1] if m["role"] == "user" for p in m["content"]
                   if isinstance(m["content"], list) and p["type"] == "image")  # fmt: skip
        checks["generation_prompt"] = prompt_ids == reference.encode(messages[: cut + 1], images[:kept], True)[0]
        checks["processor_generation_prompt"] = prompt_ids == reference.processor_call(
            messages[: cut + 1], images[:kept], True)["input_ids"][0].tolist()  # fmt: skip
        # the length pass counts what the encoder produces
        fixed, turn_lengths, _, _ = adapter.measure_many([dialogue])[0]
        checks["measure_many"] = fixed + sum(turn_lengths) == len(example.input_ids)
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            k = _first_difference(example.input_ids, want_ids)
            problems.append(f"{record['id']} ({fmt}): {failed}; ids differ first at {k}: "
                            f"{adapter.tokenizer.convert_ids_to_tokens(example.input_ids[max(0, k - 3):k + 3])} vs "
                            f"{adapter.tokenizer.convert_ids_to_tokens(want_ids[max(0, k - 3):k + 3])}")  # fmt: skip
        else:
            identical += 1
    print(f"{model_type}: {identical}/{len(records)} dialogues identical to transformers "
          f"({sum(image_counts)} images, {sum(1 for c in image_counts if c == 0)} text-only dialogues)")  # fmt: skip
    assert len(records) >= 30 and sum(image_counts) >= len(IMAGE_SPECS) * 3
    assert not problems, "\n".join(problems)
    assert identical == len(records)
