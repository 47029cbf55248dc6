"""Synthetic multi-image, multi-turn dialogues whose answers are learnable from pixels.

Each image is a solid light background with one coloured shape (4 colours x 3
shapes). Dialogues follow the MMDU layout: images are introduced as
``"Image1: <ImageHere>. Image2: <ImageHere>. "`` in the first user turn, later turns
introduce more images or none (``layout="staggered"``; ``"upfront"``: every image in the
first turn, as most MMDU dialogues do), and questions refer back to images by name.
Questions use four fixed templates; answers are one word, so a tiny model can reach
high exact match and a wrong image reference is visible in the score::

    What color is the shape in Image2?          -> red | green | blue | yellow
    What shape is in Image1?                    -> circle | square | triangle
    Do Image1 and Image3 have the same color?   -> yes | no
    Do Image2 and Image3 have the same shape?   -> yes | no

An answer is correct when :func:`is_correct` holds: equal after :func:`normalize_answer`
(lower case, surrounding whitespace and punctuation removed).

Layout written by :func:`generate_synthetic` (all image paths resolve with
``image_root = <out>/images``)::

    <out>/train.json        MMDU-45k-shaped (image names such as syn-train-000001-1.png)
    <out>/test.json         benchmark.json-shaped (paths such as /mmdu_pics/syn-test-000001-1.png)
    <out>/llava.json        llava-665k-shaped single-image split (+ ~10% text-only), JPEG images
    <out>/images/...
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mmtune.io.nofollow import open_output

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")

COLOR_Q = "What color is the shape in Image{k}?"
SHAPE_Q = "What shape is in Image{k}?"
SAME_COLOR_Q = "Do Image{j} and Image{k} have the same color?"
SAME_SHAPE_Q = "Do Image{j} and Image{k} have the same shape?"
WHICH_COLOR_Q = "Which image has a {color} shape?"
QUESTION_KINDS = ("color", "shape", "same_color", "same_shape", "which_color")
"""The question kinds; ``generate_synthetic(question_kinds=...)`` picks a subset."""

LAYOUTS = ("staggered", "upfront")
"""``staggered``: the first turn shows one or two images, later turns one new image each;
``upfront``: the first turn shows every image of the dialogue."""

STYLES = ("shape", "solid")
"""``shape``: one coloured shape on a light background (colour and shape questions);
``solid``: the whole image one colour (colour questions only, the easiest to see)."""
TEMPLATES: dict[str, dict[str, str]] = {
    "shape": {"color": COLOR_Q, "shape": SHAPE_Q, "same_color": SAME_COLOR_Q, "same_shape": SAME_SHAPE_Q,
              "which_color": WHICH_COLOR_Q},
    "solid": {"color": "What color is Image{k}?", "same_color": SAME_COLOR_Q, "which_color": "Which image is {color}?"},
}
"""The question of each kind, per image style (``solid`` images have no shape to ask about)."""


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template)
    for field in ("j", "k"):
        escaped = escaped.replace(r"\{" + field + r"\}", r"\d+")
    return re.compile(escaped.replace(r"\{color\}", r"\w+") + r"\s*$")


_KIND_PATTERNS = [(kind, _pattern(t)) for style in STYLES for kind, t in TEMPLATES[style].items()]
ANSWER_SETS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS), "shape": SHAPES, "same_color": ("yes", "no"), "same_shape": ("yes", "no"),
}
"""The possible answers of each question kind with a fixed set (``which_color``: one of the images shown)."""


def question_kind(question: str) -> str | None:
    """Which template a user turn's question is (``color``, ``shape``, ...); ``None`` if none."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(question):
            return kind
    return None


def chance_exact_match(test_json: str | os.PathLike) -> float:
    """Expected exact match (%) of guessing uniformly among each question's possible answers."""
    records = json.loads(Path(test_json).read_text(encoding="utf-8"))
    odds = []
    for record in records:
        shown = 0
        for message in record["conversations"]:
            if message["from"] in ("user", "human"):
                shown += message["value"].count("<ImageHere>")
                kind = question_kind(message["value"])
                if kind == "which_color":
                    odds.append(1 / max(shown, 1))
                else:
                    odds.append(1 / len(ANSWER_SETS[kind]) if kind else 0.0)
    return 100.0 * sum(odds) / len(odds) if odds else float("nan")


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding whitespace and punctuation."""
    return re.sub(r"\s+", " ", text).strip().strip(".,;:!?\"'`()[] ").lower()


def is_correct(prediction: str, reference: str) -> bool:
    """The synthetic benchmark's exact-match rule."""
    return normalize_answer(prediction) == normalize_answer(reference)


@dataclass(frozen=True)
class SyntheticPaths:
    """Where :func:`generate_synthetic` wrote its files."""

    train_json: str
    test_json: str
    llava_json: str
    image_dir: str
    """Image root for all three splits."""


@dataclass(frozen=True)
class _Picture:
    color: str
    shape: str


def draw_image(picture: _Picture, size: int, background: tuple[int, int, int] = (240, 240, 240), style: str = "shape"):
    """A PIL image: ``background`` with one centred shape covering ~60% of the side
    (``style="solid"``: the whole image in the picture's colour)."""
    from PIL import Image, ImageDraw

    if style == "solid":
        return Image.new("RGB", (size, size), COLORS[picture.color])
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    lo, hi = round(size * 0.2), round(size * 0.8) - 1
    fill = COLORS[picture.color]
    if picture.shape == "circle":
        draw.ellipse([lo, lo, hi, hi], fill=fill)
    elif picture.shape == "square":
        draw.rectangle([lo, lo, hi, hi], fill=fill)
    else:
        draw.polygon([(size / 2, lo), (hi, hi), (lo, hi)], fill=fill)
    return img


def _new_picture(rng: random.Random, earlier: list[_Picture]) -> _Picture:
    # Copying an earlier attribute a third of the time makes "same ...?" answers about
    # half yes, half no; independent draws would make "no" right 75% of the time.
    color = rng.choice(earlier).color if earlier and rng.random() < 1 / 3 else rng.choice(list(COLORS))
    shape = rng.choice(earlier).shape if earlier and rng.random() < 1 / 3 else rng.choice(SHAPES)
    return _Picture(color, shape)


def _question(
    rng: random.Random, pics: list[_Picture], fresh: list[int], allowed: tuple[str, ...] = QUESTION_KINDS,
    style: str = "shape", asked: frozenset[str] | None = None,
) -> tuple[str, str] | None:
    """A question about the shown images and its answer; about a just-introduced image when
    there is one. With ``asked``, only a question not in it (``None`` when none is left)."""
    if asked is not None:
        return _new_question(rng, pics, fresh, allowed, style, asked)
    templates = TEMPLATES[style]
    colors = [p.color for p in pics]
    unique = [c for c in dict.fromkeys(colors) if colors.count(c) == 1]
    kinds = [k for k in ("color", "shape") if k in allowed and k in templates]
    kinds += [k for k in ("same_color", "same_shape") if k in allowed and k in templates and len(pics) >= 2]
    if "which_color" in allowed and len(pics) >= 2 and unique:
        kinds.append("which_color")
    if not kinds:
        # Only comparisons allowed and one image shown so far: ask about that image.
        kinds = [k for k in ("color", "shape") if k in templates]
    kind = rng.choice(kinds)
    if kind in ("color", "shape"):
        k = rng.choice(fresh) if fresh else rng.randrange(len(pics))
        if kind == "color":
            return templates["color"].format(k=k + 1), pics[k].color
        return templates["shape"].format(k=k + 1), pics[k].shape
    if kind == "which_color":
        color = rng.choice(unique)
        return templates["which_color"].format(color=color), f"Image{colors.index(color) + 1}"
    j, k = sorted(rng.sample(range(len(pics)), 2))
    attr = "color" if kind == "same_color" else "shape"
    same = getattr(pics[j], attr) == getattr(pics[k], attr)
    return templates[kind].format(j=j + 1, k=k + 1), "yes" if same else "no"


def _new_question(
    rng: random.Random, pics: list[_Picture], fresh: list[int], allowed: tuple[str, ...], style: str,
    asked: frozenset[str],
) -> tuple[str, str] | None:
    """:func:`_question` without repeats: a kind among those with a question not yet asked,
    then one of its questions (about a fresh image when the kind has one left). Kept apart
    from :func:`_question` so that the default (repeats allowed) draws the same random
    numbers, and gives the same data, as before this option existed."""
    templates = TEMPLATES[style]
    colors = [p.color for p in pics]
    by_kind: dict[str, list[tuple[str, str, bool]]] = {}  # kind -> [(question, answer, about a fresh image)]
    for kind in ("color", "shape"):
        if kind in templates:
            by_kind[kind] = [(templates[kind].format(k=k + 1), getattr(p, kind), k in fresh) for k, p in enumerate(pics)]
    for kind, attr in (("same_color", "color"), ("same_shape", "shape")):
        if kind in templates:
            by_kind[kind] = [
                (templates[kind].format(j=j + 1, k=k + 1), "yes" if getattr(pics[j], attr) == getattr(pics[k], attr)
                 else "no", False)
                for j in range(len(pics)) for k in range(j + 1, len(pics))
            ]
    if "which_color" in templates and len(pics) >= 2:
        by_kind["which_color"] = [(templates["which_color"].format(color=c), f"Image{colors.index(c) + 1}", False)
                                  for c in dict.fromkeys(colors) if colors.count(c) == 1]
    applicable = {k: qs for k, qs in by_kind.items() if k in allowed and qs}
    if not applicable:
        # Only comparisons allowed and one image shown so far: ask about that image.
        applicable = {k: by_kind[k] for k in ("color", "shape") if k in by_kind}
    left = {k: [q for q in qs if q[0] not in asked] for k, qs in applicable.items()}
    kinds = [k for k, qs in left.items() if qs]
    if not kinds and fresh:
        # Everything allowed was asked, but a new image always gets a question about itself.
        left = {k: [q for q in by_kind[k] if q[2]] for k in ("color", "shape") if k in by_kind}
        kinds = [k for k, qs in left.items() if qs]
    if not kinds:
        return None
    options = left[rng.choice(kinds)]
    question, answer, _ = rng.choice([q for q in options if q[2]] or options)
    return question, answer


def _dialogue(
    rng: random.Random, min_images: int, max_images: int, max_turns: int, allowed: tuple[str, ...] = QUESTION_KINDS,
    style: str = "shape", layout: str = "staggered", repeat_questions: bool = True,
):
    """``(pictures, conversations)`` of one MMDU-style dialogue. Without ``repeat_questions``
    it ends early once every question about the shown images has been asked."""
    n_images = rng.randint(min_images, max_images)
    n_first = n_images if layout == "upfront" else rng.randint(1, min(2, n_images))
    lo = max(min(2, max_turns), 1 + n_images - n_first)
    n_turns = rng.randint(lo, max(max_turns, lo))
    # Which later turns introduce one new image each: a random subset of turns 1..n-1.
    intro_turns = sorted(rng.sample(range(1, n_turns), n_images - n_first))
    pics: list[_Picture] = []
    conversations = []
    asked: set[str] = set()
    for t in range(n_turns):
        n_new = n_first if t == 0 else intro_turns.count(t)
        fresh = []
        intro = ""
        for _ in range(n_new):
            pics.append(_new_picture(rng, pics))
            fresh.append(len(pics) - 1)
            intro += f"Image{len(pics)}: <ImageHere>. "
        qa = _question(rng, pics, fresh, allowed, style, None if repeat_questions else frozenset(asked))
        if qa is None:  # every question about the shown images was asked (never in a turn with a new image)
            break
        question, answer = qa
        asked.add(question)
        conversations.append({"from": "user", "value": intro + question})
        conversations.append({"from": "assistant", "value": answer})
    return pics, conversations


def _write(path: Path, records: list) -> None:
    with open_output(path, "w") as f:
        json.dump(records, f, ensure_ascii=False, indent=1)


def _check_options(min_images: int, max_images: int, allowed: tuple[str, ...], style: str, layout: str) -> None:
    """Raise one ``ValueError`` naming every bad option of :func:`generate_synthetic`."""
    problems = []
    if not 1 <= min_images <= max_images:
        problems.append(f"need 1 <= min_images <= max_images, got {min_images}, {max_images}")
    unknown = [k for k in allowed if k not in QUESTION_KINDS]
    if unknown or not allowed:
        problems.append(
            f"question_kinds={list(allowed)!r}: use a non-empty subset of {list(QUESTION_KINDS)} "
            f"(unknown: {unknown})"
        )
    if style not in STYLES:
        problems.append(f"style={style!r}: use one of {list(STYLES)}")
    elif style == "solid" and {"shape", "same_shape"} & set(allowed):
        problems.append("style='solid' images have no shape: drop 'shape' / 'same_shape' from question_kinds")
    if layout not in LAYOUTS:
        problems.append(f"layout={layout!r}: use one of {list(LAYOUTS)}")
    if problems:
        raise ValueError("generate_synthetic: " + "; ".join(problems))


@dataclass(frozen=True)
class _DialogueOptions:
    """The options of :func:`generate_synthetic` that shape one MMDU-format dialogue and its images."""

    min_images: int
    max_images: int
    max_turns: int
    allowed: tuple[str, ...]
    style: str
    layout: str
    repeat_questions: bool
    image_size: int


def _mmdu_split(n: int, split: str, rng: random.Random, name_of: Callable[[str], str],
                images: Path, opts: _DialogueOptions) -> list[dict]:
    """``n`` MMDU-format records of ``split``, their PNG images written under ``images``.

    ``name_of`` turns an image's file name into the path the record holds (relative to
    ``images``; the test split's names start with ``/mmdu_pics/`` as benchmark.json's do).
    """
    records = []
    for i in range(n):
        pics, conversations = _dialogue(
            rng, opts.min_images, opts.max_images, opts.max_turns, opts.allowed, opts.style, opts.layout,
            opts.repeat_questions,
        )
        paths = []
        for k, pic in enumerate(pics, 1):
            rel = name_of(f"syn-{split}-{i:06d}-{k}.png")
            with open_output(images / rel.lstrip("/"), "wb") as handle:
                draw_image(pic, opts.image_size, style=opts.style).save(handle, format="PNG")
            paths.append(rel)
        records.append({"id": f"syn-{split}-{i:06d}", "image": paths, "conversations": conversations})
    return records


def _llava_split(n: int, rng: random.Random, images: Path, image_size: int, text_only_fraction: float) -> list[dict]:
    """``n`` llava-665k-shaped records (single JPEG image, or text only), images under ``images/synthetic``."""
    llava = []
    for i in range(n):
        rid = f"syn-llava-{i:06d}"
        if rng.random() < text_only_fraction:
            word = rng.choice(list(COLORS) + list(SHAPES))
            llava.append(
                {"id": rid, "conversations": [
                    {"from": "human", "value": f"Repeat the word {word}."},
                    {"from": "gpt", "value": word},
                ]}
            )
            continue
        pic = _new_picture(rng, [])
        rel = f"synthetic/{rid}.jpg"
        draw_image(pic, image_size).save(images / rel, quality=95)
        conv = []
        for t in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                q, a = "What color is the shape?", pic.color
            else:
                q, a = "What shape is in the image?", pic.shape
            if t == 0:
                # Both placements seen in llava-665k: at the start with a newline, or at the end.
                q = f"<image>\n{q}" if rng.random() < 0.5 else f"{q}\n<image>"
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        llava.append({"id": rid, "image": rel, "conversations": conv})
    return llava


def generate_synthetic(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 200,
    n_test: int = 40,
    n_llava: int = 100,
    seed: int = 0,
    image_size: int = 32,
    min_images: int = 2,
    max_images: int = 4,
    max_turns: int = 5,
    text_only_fraction: float = 0.1,
    question_kinds: tuple[str, ...] | list[str] = ("color", "shape", "same_color", "same_shape"),
    style: str = "shape",
    layout: str = "staggered",
    repeat_questions: bool = True,
) -> SyntheticPaths:
    """Write the synthetic train / test / llava-shaped splits and their images.

    Args:
        out_dir: output folder (created).
        n_train, n_test: MMDU-format dialogues in the train and held-out test splits.
        n_llava: records of the llava-665k-shaped split.
        seed: everything is a pure function of the arguments.
        image_size: side of the square images in pixels.
        min_images, max_images: images per MMDU-format dialogue.
        max_turns: user turns per MMDU-format dialogue (raised when more images must be
            introduced, one per later turn).
        text_only_fraction: share of text-only records in the llava split.
        question_kinds: which question templates the MMDU-format splits use, a non-empty
            subset of :data:`QUESTION_KINDS` (default: the four colour / shape / same-colour /
            same-shape kinds). A turn that may only ask a comparison while one image is
            shown asks about that image's colour or shape. ``which_color`` ("Which image
            has a red shape?" -> ``Image2``) is asked only when exactly one shown image has
            that colour.
        style: :data:`STYLES`: ``shape`` (a coloured shape) or ``solid`` (the image is one
            colour; shape kinds are not allowed). The llava split always uses shapes.
        layout: :data:`LAYOUTS`: ``staggered`` (the first turn shows one or two images,
            later turns one new image each) or ``upfront`` (every image in the first turn).
        repeat_questions: ``False``: no question is asked twice in a dialogue, so a later
            turn cannot be answered by copying an earlier answer; a dialogue then ends early
            when every question about its images has been asked.

    Returns:
        The written paths.
    """
    allowed = tuple(question_kinds)
    _check_options(min_images, max_images, allowed, style, layout)
    opts = _DialogueOptions(min_images, max_images, max_turns, allowed, style, layout, repeat_questions, image_size)
    out = Path(out_dir)
    images = out / "images"
    (images / "mmdu_pics").mkdir(parents=True, exist_ok=True)
    (images / "synthetic").mkdir(parents=True, exist_ok=True)
    # Separate random streams per split: changing n_test does not change the train split.
    train = _mmdu_split(n_train, "train", random.Random(f"{seed}-train"), lambda name: name, images, opts)
    test = _mmdu_split(n_test, "test", random.Random(f"{seed}-test"), lambda name: f"/mmdu_pics/{name}", images, opts)
    llava = _llava_split(n_llava, random.Random(f"{seed}-llava"), images, image_size, text_only_fraction)

    paths = SyntheticPaths(
        train_json=str(out / "train.json"),
        test_json=str(out / "test.json"),
        llava_json=str(out / "llava.json"),
        image_dir=str(images),
    )
    _write(Path(paths.train_json), train)
    _write(Path(paths.test_json), test)
    _write(Path(paths.llava_json), llava)
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m mmtune.data.synthetic OUT_DIR [--n-train N] ...``"""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out_dir")
    p.add_argument("--n-train", type=int, default=200)
    p.add_argument("--n-test", type=int, default=40)
    p.add_argument("--n-llava", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=32)
    a = p.parse_args(argv)
    paths = generate_synthetic(
        a.out_dir, n_train=a.n_train, n_test=a.n_test, n_llava=a.n_llava, seed=a.seed, image_size=a.image_size
    )
    print(json.dumps(paths.__dict__, indent=1))
    return 0


__all__ = [
    "COLORS",
    "SHAPES",
    "QUESTION_KINDS",
    "STYLES",
    "LAYOUTS",
    "TEMPLATES",
    "ANSWER_SETS",
    "SyntheticPaths",
    "question_kind",
    "chance_exact_match",
    "generate_synthetic",
    "normalize_answer",
    "is_correct",
    "draw_image",
]

if __name__ == "__main__":
    raise SystemExit(main())
