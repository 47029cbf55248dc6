"""The auto family against transformers' own processors, dialogue by dialogue.

For each tested class (every entry of ``mmtune.testing.checkpoints.KINDS``) a
tiny checkpoint is built from transformers' classes (``mmtune.testing.checkpoints``) and
generated multi-image, multi-turn dialogues (images of many sizes and aspect ratios, several in
one turn, introduced in later turns, text-only turns and dialogues, system turns, text pieces
with odd whitespace) go through mmtune's adapter, encoder and pixel cache. The reference is the
processor itself: ``processor(text=processor.apply_chat_template(messages), images=images)``
(no second BOS when the template renders one, as the processor's own ``apply_chat_template``
does), with the messages as the record writes them (image and text items in order, every text
piece kept, empty ones dropped). Compared, for the whole dialogue:

- ``input_ids``, every image input tensor and the text-aligned ones (Gemma 3's
  ``token_type_ids``), bit for bit (one by one through the pixel cache
  and joined as the adapter declares, vs the processor's one call);
- position ids: 0..L-1, or for M-RoPE models the model's own ``get_rope_index`` on the
  processor's ids and ``mm_token_type_ids``;
- labels: on every token that starts inside what an assistant message adds to the rendered
  text beyond the generation prompt (content and end of turn), mapped onto the processor's
  tokens through the processor's own replacement offsets; and each answer's text is inside
  its labelled run; where the template puts no stop token (the model's ``eos_token_id``) in
  an answer (GLM-4.1V), the stop token it renders right after the answer is labelled too,
  appended after the last answer;
- the generation prompt of the last user turn (with only the images up to it).
"""

import json
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.encoding import encode_example, flatten
from mmtune.data.images import ImagePipeline
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.positions import rope_image_params
from mmtune.models.registry import build_adapter
from mmtune.testing.checkpoints import KINDS, save_tiny_checkpoint
from tests.support.auto_checkpoints import labelled_runs

N_DIALOGUES = 30

# (width, height): squares, wide and tall, tiny, odd sizes, up to 1:8
SIZES = [(40, 30), (30, 40), (64, 64), (90, 25), (25, 90), (17, 19), (150, 20), (20, 150), (111, 57), (57, 111),
         (200, 120), (33, 77), (80, 80), (128, 16), (16, 128), (45, 46)]  # fmt: skip
USER_TEXTS = ["What is shown?", "  Describe it.  ", "Compare {img} and {img} please.", "{img}\nWhat now?",
              "Look: {img}", "Is it raining? \n", "图里有什么？{img}", "a  b   c", "{img}{img} Two adjacent.",
              "Tabs\tand\nnewlines\n\n", " {img} , then text", "Image1: {img}\nImage2: {img}\nImage3: {img}",
              "{img}", "Numbers 1889 or 1907?"]  # fmt: skip
ANSWERS = ["Yes.", " A red helmet.\n", "1. One\n2. Two", "\nStarts with a newline.", "中文回答。", "ok ",
           "It is 42.", "Two images: left and right."]  # fmt: skip
SYSTEMS = ["You are a careful describer of images.", "Answer briefly."]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity_images")
    rng = np.random.default_rng(0)
    paths = []
    for k, (width, height) in enumerate(SIZES):
        path = str(root / f"img{k}.{'jpg' if k % 3 == 0 else 'png'}")
        PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(path)
        paths.append(path)
    return paths


def _dialogues(paths):
    """Generated dialogues; every image file is used, images come in later turns too."""
    rng = random.Random(11)
    next_image = iter(paths * 100)
    out = []
    for n in range(N_DIALOGUES):
        turns = []
        if n % 4 == 1:
            turns.append(Turn("system", (rng.choice(SYSTEMS),)))
        for k in range(rng.randint(1, 4)):
            text = rng.choice(USER_TEXTS) if n % 10 != 7 else "Only text here."
            segments = []
            for j, piece in enumerate(text.split("{img}")):
                if j:
                    segments.append(Image(next(next_image)))
                if piece:
                    segments.append(piece)
            turns += [Turn("user", tuple(segments)), Turn("assistant", (rng.choice(ANSWERS),))]
        out.append(Dialogue(f"d{n}", "generated", tuple(turns)))
    return out


def _messages(dialogue):
    return [{"role": t.role, "content": [{"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s}
                                         for s in t.segments if s != ""]} for t in dialogue.turns]  # fmt: skip


class Reference:
    """The processor of one tiny checkpoint directory, called as its documentation shows."""

    def __init__(self, directory, image_token_id):
        from transformers import AutoModel, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(directory)
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = image_token_id
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(directory)
        # the stop tokens: the tokenizer's EOS, the config's and the generation config's eos_token_id
        self.stops = {self.tokenizer.eos_token_id}
        for file in ("config.json", "generation_config.json"):
            path = os.path.join(directory, file)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    values = json.load(handle)
                for eos in (values.get("eos_token_id"), values.get("text_config", {}).get("eos_token_id")):
                    self.stops |= set(eos if isinstance(eos, list) else [eos])
        self.stops -= {None}
        self.rope = None
        model_class = AutoModel._model_mapping[type(self.config)]
        if hasattr(model_class, "get_rope_index"):
            with torch.device("meta"):
                self.rope = model_class(self.config)

    def render(self, messages, add_generation_prompt=False):
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def call(self, text, images):
        """The processor's call; :attr:`seen` is the text it hands its tokenizer (with the text its
        own call adds: Janus's default system prompt, Molmo2's BOS)."""
        from transformers.image_utils import load_image

        bos = self.tokenizer.bos_token
        kwargs = {"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}
        seen = []
        tokenizer = self.processor.tokenizer

        def recording(text=None, *args, **kw):
            seen.extend([text] if isinstance(text, str) else list(text or []))
            return tokenizer(text, *args, **kw)

        class Recorder:  # the processor's tokenizer, recording the texts it is called on
            __call__ = staticmethod(recording)

            def __getattr__(self, name):
                return getattr(tokenizer, name)

        self.processor.tokenizer = Recorder()
        try:
            out = self.processor(text=[text], images=[load_image(p) for p in images] or None, return_tensors="pt",
                                 return_text_replacement_offsets=True, return_mm_token_type_ids=True, **kwargs)
        finally:
            self.processor.tokenizer = tokenizer
        self.seen = next(t for t in seen if isinstance(t, str) and len(t) >= len(text))
        return out

    def positions(self, out):
        ids = out["input_ids"]
        if self.rope is None:
            return torch.arange(ids.shape[1])[None]
        given = {name: out[name] for name in rope_image_params(type(self.rope)) if name in out}
        positions, _ = self.rope.get_rope_index(ids, mm_token_type_ids=out["mm_token_type_ids"], **given)
        return positions[:, 0]

    def labels(self, messages, out, text, tagged=None):
        """Labels from character spans of the rendered text, moved onto the processor's tokens. A
        template that is not prefix-stable (Qwen3.5) is labelled by transformers' own assistant mask
        on ``tagged``, its copy with ``{% generation %}`` tags."""
        spans = []
        if tagged is not None:
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, indices = render_jinja_template(conversations=[messages], chat_template=tagged,
                                                      return_assistant_tokens_mask=True,
                                                      **self.tokenizer.special_tokens_map)  # fmt: skip
            assert rendered[0] == text
            spans = [list(pair) for pair in indices[0]]
        for i, message in enumerate(messages if tagged is None else []):
            if message["role"] != "assistant":
                continue
            header = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            start = next((k for k, (a, b) in enumerate(zip(header, full)) if a != b), min(len(header), len(full)))
            spans.append([start, len(full)])
        # the processor's own record of each placeholder: its span before and after expansion
        replaced = out["text_replacement_offsets"][0] if "text_replacement_offsets" in out else []
        # what the processor's call put before the text (its tokenizer saw that, expanded)
        growth = sum(len(item["replacement"]) - (item["span"][1] - item["span"][0]) for item in replaced)
        added = len(self.seen) - len(text) - growth
        text = self.seen[:added] + text
        spans = [[start + added, end + added] for start, end in spans]
        pieces, cursor = [], 0
        for item in replaced:
            a, b = item["span"]
            pieces += [text[cursor:a], item["replacement"]]
            cursor = b
        expanded = "".join(pieces) + text[cursor:]

        def moved(position):  # a position of the rendered text in the expanded one
            shifts = [item["new_span"][1] - item["span"][1] for item in replaced if item["span"][1] <= position]
            return position + (shifts[-1] if shifts else 0)

        encoding = self.tokenizer(expanded, add_special_tokens=not (self.tokenizer.bos_token and text.startswith(
            self.tokenizer.bos_token)), return_offsets_mapping=True)  # fmt: skip
        ids = out["input_ids"][0].tolist()
        assert encoding["input_ids"] == ids, "the expanded text rebuilt from the replacement offsets tokenizes differently"
        labels = [IGNORE_INDEX] * len(ids)
        for start, end in spans:
            lo, hi = moved(start), moved(end)
            for k, (s, e) in enumerate(encoding["offset_mapping"]):
                if lo <= s < hi and e > s:
                    labels[k] = ids[k]
        return labels

    def with_answer_stops(self, messages, text, ids, labels):
        """Where an answer's labelled run holds no stop token (GLM-4.1V ends an answer with the next
        ``<|user|>``), the stop token the template renders right after it is labelled too: the
        next token in the text, or, after the last answer, the first token the template renders
        after the dialogue (appended). Returns the ids and labels with them."""
        ids, labels = list(ids), list(labels)
        runs, k = [], 0
        while k < len(labels):
            if labels[k] == IGNORE_INDEX:
                k += 1
                continue
            start = k
            while k < len(labels) and labels[k] != IGNORE_INDEX:
                k += 1
            runs.append((start, k))
        for start, end in runs:
            if self.stops & set(ids[start:end]):
                continue
            if end < len(ids) and ids[end] in self.stops:
                labels[end] = ids[end]
            elif end == len(ids):
                probe = self.render(messages + [{"role": "user", "content": [{"type": "text", "text": "a"}]}])
                following = self.tokenizer(probe[len(text):], add_special_tokens=False)["input_ids"]
                if following and following[0] in self.stops:
                    ids.append(following[0])
                    labels.append(following[0])
        return ids, labels


@pytest.fixture(scope="module", params=sorted(KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    directory = save_tiny_checkpoint(str(tmp_path_factory.mktemp(kind)), kind, weights=False)
    adapter = build_adapter(ModelConfig(family="auto", path=directory))
    return kind, adapter, Reference(directory, adapter.image_token_id)




def test_dialogues_are_identical_to_the_processor(setup, images, tmp_path):
    kind, adapter, reference = setup
    dialogues = _dialogues(images)
    pipeline = ImagePipeline(adapter, cache_dir=str(tmp_path / "pixels"))
    counts = {name: 0 for name in ("input_ids", "image_inputs", "position_ids", "labels", "generation_prompt")}
    problems = []
    for dialogue in dialogues:
        messages = _messages(dialogue)
        paths = [i.path for t in dialogue.turns for i in t.images]
        text = reference.render(messages)
        out = reference.call(text, paths)
        example = encode_example(adapter, dialogue, max_length=None)
        ids = torch.tensor(example.input_ids)
        inputs = pipeline.inputs(pipeline.load_images(example.images)) if example.images else None
        tagged = KINDS[kind].fidelity_reference_template
        want_ids, want = reference.with_answer_stops(messages, text, out["input_ids"][0].tolist(),
                                                     reference.labels(messages, out, text, tagged))
        checks = {"input_ids": example.input_ids == want_ids}
        if inputs is None:
            checks["image_inputs"] = not paths and not any(n in out for n in adapter.image_input_names)
        else:
            checks["image_inputs"] = sorted(inputs) == sorted(n for n in out if n in adapter.image_input_names) and all(
                inputs[n].dtype == out[n].dtype and torch.equal(inputs[n], out[n]) for n in inputs)  # fmt: skip
        for name, value in adapter.token_inputs(ids[None]).items():  # Gemma 3's token_type_ids
            checks["image_inputs"] = checks["image_inputs"] and checks["input_ids"] and torch.equal(
                value[..., :out[name].shape[-1]], out[name])  # fmt: skip
        n = out["input_ids"].shape[1]  # the positions of the processor's tokens (an appended stop token has none)
        checks["position_ids"] = checks["input_ids"] and torch.equal(adapter.position_ids(ids, inputs)[..., :n],
                                                                     reference.positions(out))  # fmt: skip
        answers = [t.segments[0] for t in dialogue.turns if t.role == "assistant"]
        runs = [adapter.tokenizer.decode(run) for run in labelled_runs(example.labels)]
        checks["labels"] = example.labels == want and len(runs) == len(answers) and all(
            a.strip() in r for a, r in zip(answers, runs))  # fmt: skip
        cut = max(i for i, t in enumerate(dialogue.turns) if t.role == "user")
        prompt = Dialogue(dialogue.id, dialogue.source, dialogue.turns[: cut + 1])
        prompt_ids = flatten(adapter.encode_dialogue(prompt, add_generation_prompt=True), adapter.image_token_id)[0]
        prompt_paths = [i.path for t in prompt.turns for i in t.images]
        want_prompt = reference.call(reference.render(messages[: cut + 1], add_generation_prompt=True), prompt_paths)
        checks["generation_prompt"] = prompt_ids == want_prompt["input_ids"][0].tolist()
        for name, ok in checks.items():
            counts[name] += bool(ok)
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            problems.append(f"{dialogue.id}: {failed}")
    print(f"{kind}: identical / {len(dialogues)} dialogues: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    n_images = sum(len(t.images) for d in dialogues for t in d.turns)
    assert len(dialogues) >= 30 and n_images >= 2 * len(SIZES)
    assert any(t.images for d in dialogues for t in d.turns[2:])  # images in later turns
    assert any(len(t.images) >= 2 for d in dialogues for t in d.turns)  # several in one turn
    assert not problems, "\n".join(problems)
    assert pipeline.stats.decoded == len(set(i.path for d in dialogues for t in d.turns for i in t.images))
    assert pipeline.stats.cache_hits > 0  # images used again come from the pixel cache


def test_collated_batch_joins_samples_as_the_processor_does(setup, images):
    """Two samples collated: each image input equals the processor's call on both texts at once,
    where the processor's batch join is the declared one (every tested class)."""
    from mmtune.data.collator import MultiImageCollator

    kind, adapter, reference = setup
    dialogues = [d for d in _dialogues(images) if any(t.images for t in d.turns)][:2]
    examples = [encode_example(adapter, d, max_length=None) for d in dialogues]
    collate = MultiImageCollator(0, image_pipeline=ImagePipeline(adapter), adapter=adapter)
    batch = collate(examples)
    texts = [reference.render(_messages(d)) for d in dialogues]
    paths = [i.path for d in dialogues for t in d.turns for i in t.images]
    want = adapter.image_inputs(paths)  # all images of both samples joined in order
    for name in adapter.image_input_names:
        assert torch.equal(batch[name], want[name]), name
    assert batch["input_ids"].shape[0] == 2 and texts
