"""The Vicuna v1 conversation of LLaVA-1.5 (``conv_vicuna_v1``) as a Jinja chat template."""

from __future__ import annotations

__all__ = ["VICUNA_V1_CHAT_TEMPLATE", "VICUNA_V1_SYSTEM", "vicuna_v1_chat_template"]

VICUNA_V1_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


def vicuna_v1_chat_template(marker_after_special: bool = False) -> str:
    """The Vicuna v1 prompt of :class:`LlavaAdapter` as a Jinja chat template, saved with
    checkpoints so plain ``apply_chat_template`` gives the training ids.

    The official string is ``{system} USER: {user} ASSISTANT: {answer}</s>USER: ...``
    (``ASSISTANT:`` alone as the generation prompt). The official code encodes it in chunks
    split at ``<image>`` and ``</s>``, each starting with SentencePiece's word marker;
    a fast Llama tokenizer encoding the whole string adds no marker after a special token.
    ``marker_after_special`` (for such tokenizers) writes a space after ``<s>``, ``</s>`` and
    each ``<image>`` not followed by another image (the official chunk between two adjacent
    images is empty), which that tokenizer turns into the same marker.
    """
    sp = " " if marker_after_special else ""
    system = VICUNA_V1_SYSTEM.replace("'", "\\'")
    return (
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] if messages[0]['content'] is string "
        "else messages[0]['content'] | map(attribute='text') | join('') -%}"
        "{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}"
        "{%- set system = '" + system + "' -%}"
        "{%- set loop_messages = messages -%}"
        "{%- endif -%}"
        "{{- bos_token + '" + sp + "' + system -}}"
        "{%- for message in loop_messages -%}"
        "{%- if message['role'] == 'user' -%}{{- ' USER: ' if loop.first else 'USER: ' -}}"
        "{%- else -%}{{- ' ASSISTANT: ' -}}{%- endif -%}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' -%}{{- '<image>' -}}"
        + ("{%- if not (loop.nextitem is defined and loop.nextitem['type'] == 'image') -%}{{- ' ' -}}{%- endif -%}"
           if sp else "")
        + "{%- else -%}{{- item['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}{{- eos_token + ('' if loop.last else '" + sp + "') -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- ' ASSISTANT:' -}}{%- endif -%}"
    )


VICUNA_V1_CHAT_TEMPLATE = vicuna_v1_chat_template()
