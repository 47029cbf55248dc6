"""InternLM-XComposer2, native: InternLM2 decoder with Partial LoRA + CLIP ViT-L/14 + MLP projector.

The official model ships as Hugging Face remote code. This package rebuilds the same
architecture on transformers building blocks (``PreTrainedModel``, ``CLIPVisionModel``,
the attention-function registry, the masking utilities and the RoPE utilities), so it
trains through mmtune's collator, packing, distributed engines and evaluation path like LLaVA,
and loads the official checkpoint by converting its state dict (tested on random weights
with the official names and shapes; see docs/internlm_xcomposer2.md, "Limits").

Laid out as transformers lays out a model, and read in this order:

1. :mod:`.configuration`: :class:`InternLMXComposer2TextConfig`, :class:`InternLMXComposer2Config`;
2. :mod:`.modeling`: :class:`PartialLoRALinear` (a linear layer whose low-rank branch only
   touches image tokens), the InternLM2 decoder (fused ``wqkv`` attention, SwiGLU, RMSNorm,
   rotary), the vision tower wrapper and :class:`InternLMXComposer2ForCausalLM`;
3. :mod:`.conversion`: the official checkpoint's config, state dict and tokenizer to native;
4. :mod:`.tokenization`: :class:`InternLM2Tokenizer` (InternLM2's SentencePiece encoding, no remote code);
5. :mod:`.adapter`: :class:`InternLMXComposer2Adapter` (chat template, labels, preprocessing, loading).

Image convention (shared with every mmtune adapter): an image is ``N`` copies of
``config.image_token_id`` in ``input_ids``; the model swaps the embeddings at those
positions for the projected CLIP features and uses the same positions as Partial
LoRA's ``im_mask``. ``image_token_id`` defaults to the text vocabulary size (92544 for
the 7B models): one past the last row of the embedding table. It can therefore never
come out of the tokenizer's text encoding nor be generated (the output head has no
row for it), and the embedding table keeps the official shape. The adapter registers
it in the tokenizer as the added special token ``<ImageHere>`` so ids still decode.
"""

from mmtune.models.internlm_xcomposer2.adapter import IMAGE_TOKEN, TINY_ARCHITECTURE, InternLMXComposer2Adapter
from mmtune.models.internlm_xcomposer2.configuration import InternLMXComposer2Config, InternLMXComposer2TextConfig
from mmtune.models.internlm_xcomposer2.conversion import (
    CheckpointMismatchError,
    check_state_dict,
    convert_official_checkpoint,
    convert_official_state_dict,
    convert_official_tokenizer,
    load_official_checkpoint,
    load_official_state_dict,
    native_config_from_official,
)
from mmtune.models.internlm_xcomposer2.modeling import (
    InternLMXComposer2Attention,
    InternLMXComposer2DecoderLayer,
    InternLMXComposer2ForCausalLM,
    InternLMXComposer2PreTrainedModel,
    InternLMXComposer2TextModel,
    PartialLoRALinear,
)
from mmtune.models.internlm_xcomposer2.tokenization import InternLM2Tokenizer

__all__ = [
    "InternLMXComposer2TextConfig",
    "InternLMXComposer2Config",
    "PartialLoRALinear",
    "InternLMXComposer2Attention",
    "InternLMXComposer2DecoderLayer",
    "InternLMXComposer2PreTrainedModel",
    "InternLMXComposer2TextModel",
    "InternLMXComposer2ForCausalLM",
    "CheckpointMismatchError",
    "check_state_dict",
    "convert_official_state_dict",
    "load_official_state_dict",
    "native_config_from_official",
    "load_official_checkpoint",
    "convert_official_checkpoint",
    "convert_official_tokenizer",
    "InternLMXComposer2Adapter",
    "InternLM2Tokenizer",
    "IMAGE_TOKEN",
    "TINY_ARCHITECTURE",
]
