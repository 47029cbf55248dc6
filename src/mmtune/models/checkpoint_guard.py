"""Bounds on what a model folder may ask of mmtune before transformers reads it.

A checkpoint folder is input like a data file: a hostile or broken one must end in one
message naming its file, never in a traceback or a process grown past its memory. What
the ``auto`` family reads from a folder (its processor, tokenizer and template files) is
checked here first, as plain files, so nothing oversized is ever parsed or compiled:

- the tokenizer's files are at most :data:`MAX_TOKENIZER_BYTES`; every JSON file transformers parses (``config.json``, ``processor_config.json``,
  ``preprocessor_config.json``, ``tokenizer_config.json``, ...) is at most
  :data:`MAX_JSON_BYTES` and nests at most :data:`MAX_JSON_DEPTH` levels (Python's parser
  and transformers' ``to_dict`` recurse; a deeper file ends in ``RecursionError``);
- the image sizes the processor config asks for (``size``, ``crop_size``, ``max_pixels``,
  grid pinpoints, ...) stay within ``model.image_limits``: the processor builds images of
  those sizes at start-up (a 20000-px request grew past 6 GB);
- the chat template (``chat_template.jinja``, ``chat_template.json`` or the
  ``chat_template`` key of a JSON file) is at most :data:`MAX_TEMPLATE_CHARS`: Jinja
  compiles the whole of it into Python source (a 2 GB constant grew past 6 GB);
- after loading, :func:`check_chat_template` renders a short dialogue with the template
  within :data:`RENDER_SECONDS` and :data:`MAX_RENDER_CHARS`; a template that raises,
  loops or floods is refused, naming its file.

Pure functions of the folder; no model family's internals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["ModelFileError", "MAX_JSON_BYTES", "MAX_TOKENIZER_BYTES", "TOKENIZER_FILES", "MAX_JSON_DEPTH", "MAX_TEMPLATE_CHARS", "MAX_RENDER_CHARS",
           "RENDER_SECONDS", "JSON_FILES", "check_model_folder", "check_chat_template", "image_size_problems",
           "template_file"]

#: the JSON files of a model folder transformers parses with Python's json module
JSON_FILES = ("config.json", "processor_config.json", "preprocessor_config.json", "tokenizer_config.json",
              "generation_config.json", "chat_template.json", "special_tokens_map.json", "added_tokens.json",
              "video_preprocessor_config.json")
MAX_JSON_BYTES = 64 << 20
"""64 MiB: a tokenizer_config.json with 150k added tokens is about 20 MB."""
#: the tokenizer's own files, read whole by the tokenizers library
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model")
MAX_TOKENIZER_BYTES = 256 << 20
"""256 MiB: the largest published tokenizer.json (Gemma 3's) is about 33 MB."""
MAX_JSON_DEPTH = 64
"""Nesting levels of a JSON file; published configs nest fewer than 10."""
MAX_TEMPLATE_CHARS = 1 << 20
"""1 MiB of chat template; published templates are 1-20 KB."""
MAX_RENDER_CHARS = 1 << 20
"""What the probe dialogue may render to; published templates render it in under 2 KB."""
RENDER_SECONDS = 10.0
"""Wall-clock seconds the probe render may take (milliseconds for published templates)."""

# image-processor keys holding a side in pixels, and keys holding a pixel count
_SIDE_KEYS = {"height", "width", "shortest_edge", "longest_edge", "image_size", "max_image_size", "crop_size",
              "size", "max_size", "tile_size"}
_PIXEL_KEYS = {"max_pixels", "min_pixels"}


class ModelFileError(ValueError):
    """A file of the model folder asks for more than mmtune bounds, or is broken; the message names it."""


def _refuse(file: Path, what: str, fix: str) -> ModelFileError:
    return ModelFileError(f"{file}: {what}. How to fix: {fix}")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _read_json(file: Path) -> Any:
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise _refuse(file, f"{size} bytes, above the {MAX_JSON_BYTES}-byte bound on a model folder's JSON files",
                      "restore the file from the checkpoint's source")
    try:
        value = json.loads(file.read_bytes())
    except RecursionError:
        raise _refuse(file, "nests lists/objects deeper than the JSON parser can follow",
                      "restore the file from the checkpoint's source") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise _refuse(file, f"is not valid JSON ({err})", "restore the file from the checkpoint's source") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise _refuse(file, f"nests lists/objects more than {MAX_JSON_DEPTH} levels deep",
                      "restore the file from the checkpoint's source")
    return value


def image_size_problems(settings: Mapping[str, Any], limits: Any) -> list[str]:
    """The image sizes an image processor's settings ask for that exceed ``limits`` (``model.image_limits``).

    Sides (``size``, ``crop_size``, ``height``, ``longest_edge``, grid pinpoints, ...) are held
    against ``max_side``, pixel counts (``max_pixels``, ``height`` x ``width``) against ``max_pixels``.
    The processors that resize by a pixel budget (transformers' ``smart_resize``: Qwen2-VL,
    Qwen3-VL, GLM-4.1V; their settings hold ``temporal_patch_size``) write that budget as
    ``size.shortest_edge`` / ``size.longest_edge``: pixel counts there.
    """
    problems: list[str] = []
    pixel_keys = _PIXEL_KEYS | ({"shortest_edge", "longest_edge"} if "temporal_patch_size" in settings else set())
    stack: list[tuple[str, Any]] = [(key, value) for key, value in settings.items()]
    while stack:
        key, value = stack.pop()
        name = key.rsplit(".", 1)[-1]
        if isinstance(value, Mapping):
            stack.extend((f"{key}.{k}", v) for k, v in value.items())
            height, width = value.get("height"), value.get("width")
            if _number(height) and _number(width) and height * width > limits.max_pixels:
                problems.append(f"{key} asks for {height} x {width} = {height * width} pixels, above "
                                f"model.image_limits.max_pixels={limits.max_pixels}")
        elif name == "image_grid_pinpoints" and isinstance(value, list):
            sides = [side for pair in value if isinstance(pair, list) for side in pair if _number(side)]
            if sides and max(sides) > limits.max_side:
                problems.append(f"{key} holds a {max(sides)}-px side, above model.image_limits.max_side="
                                f"{limits.max_side}")
        elif name in pixel_keys:
            if _number(value) and value > limits.max_pixels:
                problems.append(f"{key}={value} pixels is above model.image_limits.max_pixels={limits.max_pixels}")
        elif name in _SIDE_KEYS and _number(value) and value > limits.max_side:
            problems.append(f"{key}={value} px is above model.image_limits.max_side={limits.max_side}")
    return sorted(problems)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def template_file(path: str | os.PathLike) -> Path:
    """The file a folder's chat template comes from, as transformers looks for it."""
    folder = Path(path)
    for name in ("chat_template.jinja", "chat_template.json", "processor_config.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file() and (name.endswith(".jinja") or name == "chat_template.json"
                               or '"chat_template"' in file.read_text(encoding="utf-8", errors="replace")):
            return file
    return folder / "tokenizer_config.json"


def _check_templates(folder: Path, parsed: Mapping[str, Any]) -> None:
    files = [folder / "chat_template.jinja", *sorted((folder / "additional_chat_templates").glob("*.jinja"))]
    for file in files:
        if file.is_file() and file.stat().st_size > MAX_TEMPLATE_CHARS:
            raise _refuse(file, f"a chat template of {file.stat().st_size} bytes, above the {MAX_TEMPLATE_CHARS}-"
                          "byte bound (Jinja compiles all of it)", "restore the template from the checkpoint's source")
    for name, value in parsed.items():
        template = value.get("chat_template") if isinstance(value, dict) else None
        texts = ([t.get("template", "") for t in template if isinstance(t, dict)] if isinstance(template, list)
                 else list(template.values()) if isinstance(template, dict) else [template])
        for text in texts:
            if isinstance(text, str) and len(text) > MAX_TEMPLATE_CHARS:
                raise _refuse(folder / name, f"a chat template of {len(text)} characters, above the "
                              f"{MAX_TEMPLATE_CHARS}-character bound (Jinja compiles all of it)",
                              "restore the template from the checkpoint's source")


def check_model_folder(path: Optional[str | os.PathLike], image_limits: Any) -> None:
    """Check a local model folder's files before transformers reads any (see the module doc).

    Args:
        path: ``model.path``; a hub id or ``None`` is not a local folder and is left alone.
        image_limits: ``model.image_limits`` (:class:`~mmtune.core.images.ImageLimits`).

    Raises:
        ModelFileError: naming the file, what it asks for, and the bound.
    """
    if path is None or not Path(path).is_dir():
        return
    folder = Path(path)
    for name in TOKENIZER_FILES:
        file = folder / name
        if file.is_file() and file.stat().st_size > MAX_TOKENIZER_BYTES:
            raise _refuse(file, f"{file.stat().st_size} bytes, above the {MAX_TOKENIZER_BYTES}-byte bound on a "
                          "tokenizer file", "restore the file from the checkpoint's source")
    parsed = {name: _read_json(folder / name) for name in JSON_FILES if (folder / name).is_file()}
    _check_templates(folder, parsed)
    for name in ("preprocessor_config.json", "processor_config.json"):
        settings = parsed.get(name)
        if isinstance(settings, dict):
            image = settings.get("image_processor") if name == "processor_config.json" else settings
            problems = image_size_problems(image, image_limits) if isinstance(image, dict) else []
            if problems:
                raise _refuse(folder / name, "the image processor asks for images larger than mmtune decodes: "
                              + "; ".join(problems), "restore the file from the checkpoint's source, or raise "
                              "model.image_limits if such images are meant")


_PROBE = [  # what every template of the family must render: user and assistant alternating, an image first
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    {"role": "user", "content": [{"type": "text", "text": "And its colour?"}]},
]


def _render_probe(template: str, special_tokens: dict[str, Any], max_chars: int, reply: Any) -> None:
    """In the child: render :data:`_PROBE`, chunk by chunk so a flood stops at ``max_chars``; send what happened."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        size = 0
        for chunk in _compile_jinja_template(template).generate(messages=_PROBE, add_generation_prompt=True,
                                                                 **special_tokens):
            size += len(chunk)
            if size > max_chars:
                reply.send(("flood", ""))
                return
        reply.send(("ok", ""))
    except (Exception, RecursionError) as err:  # noqa: BLE001 - Jinja and the template's own raise_exception
        reply.send(("error", f"{type(err).__name__}: {str(err)[:300]}"))


def _render_outcome(template: str, special_tokens: dict[str, Any]) -> tuple[str, str]:
    """``(outcome, detail)`` of rendering the probe: ``ok``, ``flood``, ``error`` or ``timeout``.

    The render runs in a forked child that is killed at :data:`RENDER_SECONDS`: a template loop
    yields to nothing (no signal, no thread) that could stop it in this process. Where fork is
    not available the render runs here, bounded in output only.
    """
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        receiver = _Inline()
        _render_probe(template, special_tokens, MAX_RENDER_CHARS, receiver)
        return receiver.value
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_render_probe, args=(template, special_tokens, MAX_RENDER_CHARS, sender),
                            daemon=True)
    child.start()
    sender.close()
    try:
        if receiver.poll(RENDER_SECONDS):
            return receiver.recv()
        return "timeout", f"rendering took more than {RENDER_SECONDS:g} s"
    except EOFError:  # the child died without a word (killed, out of memory)
        return "error", f"the rendering process ended with exit code {child.exitcode}"
    finally:
        child.kill()
        child.join()
        receiver.close()


class _Inline:
    """A pipe end for :func:`_render_probe` run in this process: keeps what it is sent."""

    value: tuple[str, str] = ("error", "nothing rendered")

    def send(self, value: tuple[str, str]) -> None:
        self.value = value


def check_chat_template(template: str, path: str | os.PathLike, special_tokens: Mapping[str, Any]) -> None:
    """Render a short dialogue with the chat template within :data:`RENDER_SECONDS` and :data:`MAX_RENDER_CHARS`.

    Compiled and rendered as transformers does (its sandboxed Jinja environment), in a child
    process killed at the time bound (:func:`_render_outcome`), output consumed chunk by chunk
    so a flood stops at the size bound.

    Raises:
        ModelFileError: the template is too long, fails to compile or to render, or exceeds
            a bound; naming its file (:func:`template_file`).
    """
    file = template_file(path)
    if len(template) > MAX_TEMPLATE_CHARS:
        raise _refuse(file, f"a chat template of {len(template)} characters, above the {MAX_TEMPLATE_CHARS}-character "
                      "bound", "restore the template from the checkpoint's source")
    fix = "restore the template from the checkpoint's source, or save a working one with the processor"
    outcome, detail = _render_outcome(template, dict(special_tokens))
    if outcome == "flood":
        raise _refuse(file, f"the chat template renders a three-message dialogue to more than {MAX_RENDER_CHARS} "
                      "characters", fix)
    if outcome == "timeout":
        raise _refuse(file, f"the chat template does not finish rendering a three-message dialogue ({detail})", fix)
    if outcome == "error":
        raise _refuse(file, f"the chat template fails on a three-message dialogue ({detail})", fix)
