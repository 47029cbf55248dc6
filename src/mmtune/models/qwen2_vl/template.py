"""The Qwen-VL chat format (ChatML), rendered turn by turn into pieces.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL instruct checkpoints all render a conversation as::

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{text}<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\\n
    <|im_start|>assistant\\n{answer}<|im_end|>\\n
    ...
    <|im_start|>assistant\\n                      (the generation prompt)

Their templates differ only in the system prompt used when the conversation has none:
Qwen2-VL and Qwen2.5-VL add ``You are a helpful assistant.``, Qwen3-VL adds no system
block. :class:`ChatMLRenderer` renders that format into :class:`~mmtune.models._utils.Piece`
objects (text runs between special tokens are tokenized separately, which equals
tokenizing the whole string because the tokenizer never merges across a special token);
:func:`renderer_for_template` reads the default system prompt off the checkpoint's own
template and checks on probe conversations that the template renders exactly what the
renderer does, so a checkpoint with a different template is refused instead of trained
on the wrong tokens.

The templates below are the released ones: :data:`QWEN2_VL_CHAT_TEMPLATE` is the
``chat_template.json`` of the Qwen/Qwen2-VL-*-Instruct repositories on the Hugging Face hub,
which the Qwen/Qwen2.5-VL-*-Instruct repositories ship unchanged; :data:`QWEN3_VL_CHAT_TEMPLATE`
is the ``chat_template.json`` of Qwen/Qwen3-VL-8B-Instruct (the instruct variant; the
thinking variants inject ``<think>`` blocks and are not this renderer's format).

Conversation building follows the official fine-tuning code (QwenLM's ``qwen-vl-finetune``,
``qwenvl/data/data_processor.py``: ``_build_messages`` + ``preprocess_qwen_visual``):

- each user text run between images is stripped and empty runs are dropped;
- assistant text is kept verbatim; images in assistant turns are refused;
- labels: everything an assistant message adds after its ``<|im_start|>assistant\\n``
  header, i.e. the answer, its ``<|im_end|>`` and the ``\\n`` after it. The official code
  labels from the second token after the ``assistant`` token, so when an answer starts
  with a newline that merges with the header's ``\\n`` into one token, that token stays
  unlabelled there and here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.models._utils import Piece, Plan

__all__ = [
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "CHAT_TEMPLATES",
    "TemplateMismatchError",
    "ChatMLRenderer",
    "user_runs",
    "renderer_for_template",
]

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

QWEN3_VL_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

#: the official template of each ``model_type`` (used for random-weight tiny models)
CHAT_TEMPLATES = {
    "qwen2_vl": QWEN2_VL_CHAT_TEMPLATE,
    "qwen2_5_vl": QWEN2_VL_CHAT_TEMPLATE,
    "qwen3_vl": QWEN3_VL_CHAT_TEMPLATE,
}

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


class TemplateMismatchError(ValueError):
    """The checkpoint's chat template does not render the Qwen-VL ChatML layout."""


def user_runs(segments: Sequence[Any]) -> list[Any]:
    """A user turn's segments as the official code builds its message: adjacent text joined,
    each text run between images stripped, empty runs dropped, images in place."""
    runs: list[Any] = []
    text: list[str] = []

    def flush() -> None:
        joined = "".join(text).strip()
        if joined:
            runs.append(joined)
        text.clear()

    for segment in segments:
        if isinstance(segment, str):
            text.append(segment)
        else:
            flush()
            runs.append(segment)
    flush()
    return runs


@dataclass(frozen=True)
class ChatMLRenderer:
    """Renders a :class:`Dialogue` in the Qwen-VL ChatML layout into pieces.

    Special tokens become ``ids`` pieces, text runs between them ``text`` pieces, each image
    an ``image`` piece between ``<|vision_start|>`` and ``<|vision_end|>``. ``answer_plain``
    is how many leading tokens of ``"assistant\\n" + answer`` stay unlabelled: the tokens of
    the role name plus the one that carries the header's newline.
    """

    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    default_system: str | None
    answer_plain: int

    def plan(
        self, dialogue: Dialogue, system_prompt: str | None, train_on: str, add_generation_prompt: bool
    ) -> Plan:
        """Prefix (system block), one piece list per non-system turn, suffix (generation prompt).

        A leading system turn of the dialogue wins over ``system_prompt``; ``system_prompt``
        (``""`` included: an empty system message) replaces the template's default.
        """
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns: Sequence[Turn] = dialogue.turns
        offset = 0
        system = self.default_system if system_prompt is None else system_prompt
        if turns and turns[0].role == "system":
            if turns[0].images:
                raise ValueError(
                    f"dialogue {dialogue.id!r}, turn 0: the system turn holds {len(turns[0].images)} image(s); "
                    "move them into a user turn"
                )
            system, offset = turns[0].text, 1
        prefix = [] if system is None else self._message("system", [system])
        body = turns[offset:]
        last_assistant = max((i for i, t in enumerate(body) if t.role == "assistant"), default=-1)
        rendered: list[tuple[str, list[Piece]]] = []
        for index, turn in enumerate(body):
            where = f"dialogue {dialogue.id!r}, turn {index + offset}"
            if turn.role == "user":
                rendered.append(("user", self._message("user", user_runs(turn.segments))))
            elif turn.role == "assistant":
                if turn.images:
                    raise ValueError(
                        f"{where}: an assistant turn holds {len(turn.images)} image(s); Qwen-VL's official "
                        "fine-tuning data puts images in user turns only: move the image into the user turn"
                    )
                trainable = train_on == "all_assistant" or index == last_assistant
                rendered.append(("assistant", self._answer(turn.text, trainable)))
            else:
                raise ValueError(
                    f"{where}: role {turn.role!r} is not allowed here; only 'user' and 'assistant' turns follow "
                    "(a 'system' turn must come first)"
                )
        suffix: list[Piece] = []
        if add_generation_prompt:
            if not body or body[-1].role != "user":
                raise ValueError(
                    f"dialogue {dialogue.id!r}: add_generation_prompt needs the dialogue to end with a user turn"
                )
            suffix = [Piece("ids", (self.im_start,)), Piece("text", "assistant\n")]
        return prefix, rendered, suffix

    def _message(self, role: str, runs: Sequence[Any]) -> list[Piece]:
        pieces = [Piece("ids", (self.im_start,))]
        text = role + "\n"  # the header shares a tokenizer call with the text run after it
        for run in runs:
            if isinstance(run, Image):
                if text:
                    pieces.append(Piece("text", text))
                pieces += [Piece("ids", (self.vision_start,)), Piece("image", run), Piece("ids", (self.vision_end,))]
                text = ""
            else:
                text += run
        if text:
            pieces.append(Piece("text", text))
        pieces += [Piece("ids", (self.im_end,)), Piece("text", "\n")]
        return pieces

    def _answer(self, text: str, trainable: bool) -> list[Piece]:
        return [
            Piece("ids", (self.im_start,)),
            Piece("text", "assistant\n" + text, trainable, plain=self.answer_plain),
            Piece("ids", (self.im_end,), trainable),
            Piece("text", "\n", trainable),
        ]

    def render_text(self, dialogue: Dialogue, system_prompt: str | None, add_generation_prompt: bool,
                    token_text: dict[int, str]) -> str:
        """The string the template would render (each image as one ``<|image_pad|>``)."""
        prefix, rendered, suffix = self.plan(dialogue, system_prompt, "all_assistant", add_generation_prompt)
        out = []
        for piece in prefix + [p for _, pieces in rendered for p in pieces] + suffix:
            if piece.kind == "text":
                out.append(piece.value)
            elif piece.kind == "ids":
                out.append("".join(token_text[i] for i in piece.value))
            else:
                out.append(IMAGE_PAD)
        return "".join(out)


def _messages(dialogue: Dialogue, system_prompt: str | None) -> list[dict[str, Any]]:
    """The probe dialogue as chat-template messages (content parts as the official code builds them)."""
    messages: list[dict[str, Any]] = []
    turns = list(dialogue.turns)
    if turns and turns[0].role == "system":
        messages.append({"role": "system", "content": turns[0].text})
        turns = turns[1:]
    elif system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    for turn in turns:
        if turn.role == "user":
            content = [{"type": "image"} if isinstance(r, Image) else {"type": "text", "text": r}
                       for r in user_runs(turn.segments)]  # fmt: skip
        else:
            content = [{"type": "text", "text": turn.text}]
        messages.append({"role": turn.role, "content": content})
    return messages


def _probes() -> list[tuple[Dialogue, str | None, bool]]:
    image = Image("probe.png")
    return [
        (Dialogue("probe-1", "probe", (Turn("user", ("Hi",)),)), None, True),
        (Dialogue("probe-2", "probe", (Turn("user", ("What is it?",)), Turn("assistant", ("A cat.",)))), None, False),
        (Dialogue("probe-3", "probe", (
            Turn("system", ("Be brief.",)),
            Turn("user", ("Image1: ", image, "\nImage2: ", image, " Compare them.")),
            Turn("assistant", ("\nThe first is larger.",)),
            Turn("user", (image,)),
            Turn("assistant", ("",)),
            Turn("user", ("And now?",)),
        )), None, True),  # fmt: skip
        (Dialogue("probe-4", "probe", (Turn("user", (image, "Describe.")), Turn("assistant", ("Red.",)))), "S", False),
    ]


def renderer_for_template(template: str, tokenizer: Any, where: str) -> ChatMLRenderer:
    """A :class:`ChatMLRenderer` for the checkpoint's chat ``template``.

    The default system prompt is what the template renders before a conversation without a
    system message. Then every probe conversation (system turns, images between text, an
    empty answer, an answer starting with a newline, generation prompts) must render the
    same string through the template and through the renderer.

    Raises:
        TemplateMismatchError: the template renders something else (names the probe and the
            first differing characters).
        ValueError: the tokenizer lacks a Qwen-VL special token.
    """
    specials = {name: tokenizer.convert_tokens_to_ids(name) for name in (IM_START, IM_END, VISION_START, VISION_END)}
    missing = [name for name, i in specials.items() if i is None or tokenizer.convert_ids_to_tokens(i) != name]
    if missing:
        raise ValueError(
            f"the tokenizer of {where} has no {missing} token(s); it is not a Qwen-VL tokenizer (use the checkpoint's "
            "own tokenizer files)"
        )

    def apply(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    bare = apply([{"role": "user", "content": [{"type": "text", "text": "x"}]}], False)
    head = IM_START + "system\n"
    default_system = None
    if bare.startswith(head) and IM_END in bare:
        default_system = bare[len(head) : bare.index(IM_END)]
    role_tokens = len(tokenizer("assistant", add_special_tokens=False)["input_ids"])
    renderer = ChatMLRenderer(
        im_start=specials[IM_START], im_end=specials[IM_END], vision_start=specials[VISION_START],
        vision_end=specials[VISION_END], default_system=default_system, answer_plain=role_tokens + 1,
    )  # fmt: skip
    token_text = {i: name for name, i in specials.items()}
    for dialogue, system_prompt, generation in _probes():
        want = apply(_messages(dialogue, system_prompt), generation)
        got = renderer.render_text(dialogue, system_prompt, generation, token_text)
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise TemplateMismatchError(
                f"the chat template of {where} does not render the Qwen-VL ChatML layout the qwen2_vl adapter encodes "
                f"(probe {dialogue.id}): first difference at character {k}: adapter {got[max(0, k - 30) : k + 30]!r} "
                f"vs template {want[max(0, k - 30) : k + 30]!r}. The adapter supports the released Qwen2-VL / "
                "Qwen2.5-VL / Qwen3-VL instruct templates (mmtune.models.qwen2_vl.CHAT_TEMPLATES); put one of them "
                "into the checkpoint's chat_template.json"
            )
    return renderer
