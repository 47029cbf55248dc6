"""Teacher calls: prompt templates and the OpenAI-compatible client.

The client is the evaluation judge's (:class:`~mmtune.evaluation.judge.client.JudgeClient`):
the same SQLite reply cache (what makes a killed build resumable without paying twice),
retries with backoff, cost counters and key redaction. Only the settings differ: the
teacher reads its own environment variables (``MMTUNE_TEACHER_*``).

Templates are ``string.Template`` files (``$field``), so JSON braces in them need no
escaping; a user replaces one by pointing ``prompts.<name>`` at a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from string import Template
from typing import Mapping, Optional, Sequence

from mmtune.data.build.config import PromptsConfig, TeacherConfig
from mmtune.data.build.sets import SetImage
from mmtune.evaluation.config import JudgeConfig
from mmtune.evaluation.judge.client import JudgeClient, JudgeRequest

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
FIELDS = {
    "summarize": ("text", "tags"),
    "per_image": ("caption", "tags", "text", "n_pairs"),
    "cross_image": ("images", "n_images", "n_pairs"),
}


class Prompts:
    """The three templates, checked for unknown ``$fields`` when loaded.

    Raises:
        ValueError: a template uses a field its stage does not provide (names the file).
    """

    def __init__(self, cfg: PromptsConfig):
        self.cfg = cfg
        self.templates: dict[str, Template] = {}
        for name, fields in FIELDS.items():
            path = getattr(cfg, name) or str(PROMPTS_DIR / f"{name}.txt")
            template = Template(Path(path).read_text(encoding="utf-8"))
            unknown = set(template.get_identifiers()) - set(fields)
            if unknown:
                raise ValueError(
                    f"prompt template {path}: unknown field(s) {sorted(unknown)}; "
                    f"the {name} stage provides {list(fields)} (write a literal $ as $$)"
                )
            self.templates[name] = template

    def summarize(self, text: str, tags: Sequence[str]) -> str:
        return self.templates["summarize"].safe_substitute(text=text, tags=", ".join(tags) or "none")

    def per_image(self, image: SetImage, text: str) -> str:
        return self.templates["per_image"].safe_substitute(
            caption=image.caption or "none", tags=", ".join(image.tags) or "none", text=text or "none",
            n_pairs=self.cfg.per_image_pairs,
        )

    def cross_image(self, images: Sequence[SetImage], texts: Mapping[str, str]) -> str:
        lines = []
        for k, image in enumerate(images, 1):
            lines.append(f"Image{k}: caption: {image.caption or 'none'}; tags: {', '.join(image.tags) or 'none'}; "
                         f"background: {texts.get(image.entry_id) or 'none'}")
        return self.templates["cross_image"].safe_substitute(
            images="\n".join(lines), n_images=len(images), n_pairs=self.cfg.cross_image_pairs
        )


def judge_config(cfg: TeacherConfig) -> JudgeConfig:
    """The judge client's settings for a teacher (its own env vars, images on by default)."""
    return JudgeConfig(
        model=cfg.model, model_env=cfg.model_env, base_url_env=cfg.base_url_env, api_key_env=cfg.api_key_env,
        concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
        backoff_base_s=cfg.backoff_base_s, backoff_max_s=cfg.backoff_max_s, max_tokens=cfg.max_tokens,
        send_images=cfg.send_images, prices=dict(cfg.prices),
    )


def teacher_client(
    cfg: TeacherConfig, cache_path: str | os.PathLike, env: Optional[dict[str, str]] = None
) -> JudgeClient:
    """An OpenAI-compatible client with the reply cache at ``cache_path``.

    Raises:
        mmtune.evaluation.judge.client.JudgeError: no model name (config or ``$MMTUNE_TEACHER_MODEL``).
    """
    from mmtune.evaluation.chat_api import TEACHER

    return JudgeClient(judge_config(cfg), cache_path=cache_path, env=env, role=TEACHER)


def request(prompt: str, images: Sequence[str], cfg: TeacherConfig) -> JudgeRequest:
    return JudgeRequest(prompt=prompt, images=tuple(images), temperature=cfg.temperature, max_tokens=cfg.max_tokens)


__all__ = ["Prompts", "PROMPTS_DIR", "judge_config", "teacher_client", "request"]
