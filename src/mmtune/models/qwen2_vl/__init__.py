"""The Qwen2-VL family: Qwen2-VL, Qwen2.5-VL and Qwen3-VL on transformers' own classes.

- :mod:`.template`: the released chat templates and their turn-by-turn rendering (ChatML,
  the official fine-tuning code's conversation building and labels);
- :mod:`.images`: image token counts from the file header, pixel inputs equal to the
  image processor's (``pixel_values`` + ``image_grid_thw``);
- M-RoPE position ids: :class:`~mmtune.models.positions.RopeIndex` (shared with the ``auto`` family);
- :mod:`.adapter`: :class:`Qwen2VLAdapter` (``model.family: qwen2_vl``);
- tiny random-weight checkpoints for tests and CPU runs: :mod:`mmtune.testing.qwen2_vl` (its names
  are looked up here on first use, so the registry's import of this package does not load them).

See ``docs/qwen2_vl.md``.
"""

from mmtune.models.qwen2_vl.adapter import Qwen2VLAdapter, load_chat_template
from mmtune.models.qwen2_vl.classes import MODEL_TYPES, model_classes
from mmtune.models.qwen2_vl.images import QwenVLImages, UnsupportedImageError, oriented_size
from mmtune.models.positions import RopeIndex
from mmtune.models.qwen2_vl.template import (
    CHAT_TEMPLATES,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    ChatMLRenderer,
    TemplateMismatchError,
    renderer_for_template,
    user_runs,
)

__all__ = [
    "Qwen2VLAdapter",
    "load_chat_template",
    "model_classes",
    "QwenVLImages",
    "UnsupportedImageError",
    "oriented_size",
    "RopeIndex",
    "CHAT_TEMPLATES",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "ChatMLRenderer",
    "TemplateMismatchError",
    "renderer_for_template",
    "user_runs",
    "MODEL_TYPES",
    "SPECIAL_TOKENS",
    "TINY_ARCHITECTURES",
    "save_tiny_checkpoint",
    "tiny_image_processor",
    "tiny_model_config",
    "tiny_tokenizer",
]

_TESTING = frozenset({"SPECIAL_TOKENS", "TINY_ARCHITECTURES", "save_tiny_checkpoint", "tiny_image_processor",
                      "tiny_model_config", "tiny_tokenizer"})


def __getattr__(name: str):
    # the tiny builders live in mmtune.testing, imported only when asked for
    if name in _TESTING:
        from mmtune.testing import qwen2_vl

        return getattr(qwen2_vl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
