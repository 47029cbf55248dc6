"""InternLM-XComposer2, native: InternLM2 decoder with Partial LoRA + CLIP ViT-L/14 + MLP projector.

The official model ships as Hugging Face remote code. This file rebuilds the same
architecture on transformers building blocks (``PreTrainedModel``, ``CLIPVisionModel``,
the attention-function registry, the masking utilities and the RoPE utilities), so it
trains through mmtune's collator, packing, DeepSpeed and evaluation path like LLaVA,
and loads the official checkpoint by converting its state dict.

Reading order:

1. configs: :class:`InternLMXComposer2TextConfig`, :class:`InternLMXComposer2Config`;
2. :class:`PartialLoRALinear` (a linear layer whose low-rank branch only touches image tokens);
3. the InternLM2 decoder (fused ``wqkv`` attention, SwiGLU, RMSNorm, rotary);
4. the vision tower wrapper and :class:`InternLMXComposer2ForCausalLM`;
5. the official-checkpoint converter;
6. :class:`InternLMXComposer2Adapter` (chat template, labels, preprocessing, loading).

Image convention (shared with every mmtune adapter): an image is ``N`` copies of
``config.image_token_id`` in ``input_ids``; the model swaps the embeddings at those
positions for the projected CLIP features and uses the same positions as Partial
LoRA's ``im_mask``. ``image_token_id`` defaults to the text vocabulary size (92544 for
the 7B models): one past the last row of the embedding table. It can therefore never
come out of the tokenizer's text encoding nor be generated (the output head has no
row for it), and the embedding table keeps the official shape. The adapter registers
it in the tokenizer as the added special token ``<ImageHere>`` so ids still decode.
"""

# No `from __future__ import annotations`: transformers reads `config: <ConfigClass>` annotations at run time.

import copy
import glob
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from mmtune.data.dialogue import Image
from mmtune.models._utils import (
    Piece,
    PieceAdapter,
    Plan,
    build_random_model,
    check_template_words,
    deep_update,
    load_dtype_and_attention,
    state_fingerprint,
)
from mmtune.models.base import ModuleGroups, unwrap_model
from mmtune.models.config import ModelConfig
from mmtune.models.images import SquareImage, SquareImageAdapter
from mmtune.models.registry import register_adapter
from mmtune.models.tiny_tokenizer import cached_tiny_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.dialogue import Dialogue

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

# -------------------------------------------------------------------------------------------------
# 1. Configs
# -------------------------------------------------------------------------------------------------

#: InternLM2-7B rotary settings: theta 1e6 and dynamic NTK with factor 1.0, which only
#: changes the base once a sequence grows past ``max_position_embeddings`` (32768).
_INTERNLM2_ROPE = {"rope_type": "dynamic", "factor": 1.0, "rope_theta": 1_000_000.0}

# CLIP ViT-L/14 as the official vision tower; image_size is the XC2-VL input (490 px).
_CLIP_VIT_L_14 = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 490,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


class InternLMXComposer2TextConfig(PreTrainedConfig):
    r"""InternLM2 language model with Partial LoRA (defaults: the 7B model of XC2).

    Args:
        vocab_size: rows of ``tok_embeddings`` and ``output`` (92544).
        hidden_size / intermediate_size: model width (4096) and SwiGLU width (14336).
        num_hidden_layers / num_attention_heads / num_key_value_heads: 32 / 32 / 8.
        head_dim: per-head width; ``None`` = hidden_size // num_attention_heads.
        max_position_embeddings: pretrained window (32768).
        rms_norm_eps: RMSNorm epsilon (1e-5).
        rope_parameters: transformers RoPE dict (``rope_type``, ``rope_theta``, ``factor``...);
            ``None`` = InternLM2's dynamic NTK, theta 1e6. ``rope_scaling`` is accepted as an alias.
        plora_r / plora_alpha / plora_dropout: Partial LoRA rank, alpha (scaling alpha/r) and
            dropout (official: 256, 256, 0.05).
        attention_dropout: dropout on attention probabilities (0).
        initializer_range: std of the normal init of random-weight models.
    """

    model_type = "internlm_xcomposer2_text"
    base_config_key = "text_config"
    default_theta = 1_000_000.0

    vocab_size: int = 92544
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    plora_r: int = 256
    plora_alpha: float = 256.0
    plora_dropout: float = 0.05
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = 2
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None and not kwargs.get("rope_scaling"):
            self.rope_parameters = dict(_INTERNLM2_ROPE)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            problems.append(
                f"head_dim ({self.head_dim}) x num_attention_heads ({self.num_attention_heads}) = "
                f"{self.head_dim * self.num_attention_heads}, expected hidden_size ({self.hidden_size})"
            )
        if self.plora_r <= 0:
            problems.append(f"plora_r must be positive, got {self.plora_r}")
        if problems:
            raise ValueError("invalid InternLM-XComposer2 text config: " + "; ".join(problems))


class InternLMXComposer2Config(PreTrainedConfig):
    r"""InternLM-XComposer2: text config, CLIP vision config and the image token.

    Args:
        text_config: :class:`InternLMXComposer2TextConfig` (or its dict).
        vision_config: ``CLIPVisionConfig`` (or its dict); default ViT-L/14 at 490 px (XC2-VL).
        image_token_id: id standing for one image feature in ``input_ids``; ``None`` =
            ``text_config.vocab_size`` (outside the embedding table, see the module docstring).
    """

    model_type = "internlm_xcomposer2"
    sub_configs_defaults = {
        "text_config": InternLMXComposer2TextConfig,
        "vision_config": SubConfigSpec(config_class=CLIPVisionConfig, init_kwargs=_CLIP_VIT_L_14),
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.image_token_id is None:
            self.image_token_id = self.text_config.vocab_size

    @property
    def num_image_tokens(self) -> int:
        """Tokens per image: the patch grid, CLS dropped (1225 at 490 px, 256 at 224 px)."""
        return (self.vision_config.image_size // self.vision_config.patch_size) ** 2


# -------------------------------------------------------------------------------------------------
# 2. Partial LoRA
# -------------------------------------------------------------------------------------------------


class PartialLoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank branch applied only at image-token positions.

    ``out = x W^T`` everywhere, ``+ Plora_B(Plora_A(dropout(x))) * alpha / r`` where
    ``im_mask`` is true. The branch runs on the selected rows even when there are none,
    so every rank calls ``Plora_A``/``Plora_B`` on every step (ZeRO-3 gathers parameters
    per module call and would hang otherwise) and their gradients are zeros, not None.
    Subclassing ``nn.Linear`` lets peft wrap it with an ordinary LoRA layer; peft passes
    ``im_mask`` through to this forward.
    """

    def __init__(self, in_features: int, out_features: int, *, r: int, alpha: float, dropout: float):
        super().__init__(in_features, out_features, bias=False)
        self.lora_r = r
        self.lora_scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout)
        self.Plora_A = nn.Linear(in_features, r, bias=False)
        self.Plora_B = nn.Linear(r, out_features, bias=False)

    def forward(self, x: torch.Tensor, im_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(x)
        if im_mask is None:
            im_mask = torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
        elif im_mask.shape != x.shape[:-1]:
            raise ValueError(f"im_mask has shape {tuple(im_mask.shape)}, expected {tuple(x.shape[:-1])} (input {tuple(x.shape)})")
        delta = self.Plora_B(self.Plora_A(self.lora_dropout(x[im_mask]))) * self.lora_scaling
        return out.index_put((im_mask,), delta.to(out.dtype), accumulate=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, plora_r={self.lora_r}, plora_scaling={self.lora_scaling}"


def _plora(config: InternLMXComposer2TextConfig, in_features: int, out_features: int) -> PartialLoRALinear:
    return PartialLoRALinear(
        in_features, out_features, r=config.plora_r, alpha=config.plora_alpha, dropout=config.plora_dropout
    )


# -------------------------------------------------------------------------------------------------
# 3. InternLM2 decoder
# -------------------------------------------------------------------------------------------------


class InternLMXComposer2RMSNorm(LlamaRMSNorm):
    """RMSNorm (identical to Llama's)."""


class InternLMXComposer2RotaryEmbedding(LlamaRotaryEmbedding):
    """Rotary embedding reading ``config.rope_parameters`` (default, linear, dynamic, yarn, ...).

    Built from the text config alone, so ``mmtune.models.rope`` can rebuild it after
    changing the scaling.
    """

    def __init__(self, config: InternLMXComposer2TextConfig):
        params = config.rope_parameters
        if params and params.get("rope_type") == "dynamic" and "factor" not in params:
            # InternLM2's own setting is dynamic NTK at factor 1.0 (no change inside the
            # window); a scaling rewrite that keeps the type but drops the factor means that.
            params["factor"] = 1.0
        super().__init__(config)


class InternLMXComposer2MLP(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, each projection with Partial LoRA."""

    def __init__(self, config: InternLMXComposer2TextConfig):
        super().__init__()
        self.w1 = _plora(config, config.hidden_size, config.intermediate_size)
        self.w3 = _plora(config, config.hidden_size, config.intermediate_size)
        self.w2 = _plora(config, config.intermediate_size, config.hidden_size)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor, im_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x, im_mask)) * self.w3(x, im_mask), im_mask)


class InternLMXComposer2Attention(nn.Module):
    """Grouped-query attention with InternLM2's fused ``wqkv``.

    ``wqkv`` rows are grouped per key/value head: for each of the ``num_key_value_heads``
    groups, ``num_attention_heads // num_key_value_heads`` query heads, then one key
    head, then one value head (``head_dim`` rows each). Query heads are therefore
    numbered group by group, which is exactly the order ``repeat_kv`` expands keys in.
    """

    def __init__(self, config: InternLMXComposer2TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.wqkv = _plora(
            config, config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        )
        self.wo = _plora(config, self.num_heads * self.head_dim, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        im_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        qkv = self.wqkv(hidden_states, im_mask)
        qkv = qkv.view(*input_shape, self.num_key_value_heads, self.num_key_value_groups + 2, self.head_dim)
        query_states = qkv[..., : self.num_key_value_groups, :].reshape(*input_shape, self.num_heads, self.head_dim)
        query_states = query_states.transpose(1, 2)
        key_states = qkv[..., -2, :].transpose(1, 2)
        value_states = qkv[..., -1, :].transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.wo(attn_output, im_mask), attn_weights


class InternLMXComposer2DecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, config: InternLMXComposer2TextConfig, layer_idx: int):
        super().__init__()
        self.attention = InternLMXComposer2Attention(config, layer_idx)
        self.feed_forward = InternLMXComposer2MLP(config)
        self.attention_norm = InternLMXComposer2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = InternLMXComposer2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        im_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.attention(
            self.attention_norm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            im_mask=im_mask,
            # flash-attention reads packed-sequence boundaries from position_ids
            position_ids=position_ids,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.ffn_norm(hidden_states), im_mask)
        return residual + hidden_states


class InternLMXComposer2PreTrainedModel(PreTrainedModel):
    config: InternLMXComposer2Config
    base_model_prefix = "model"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["InternLMXComposer2DecoderLayer", "CLIPEncoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # A fresh Partial LoRA branch is a no-op (as for LoRA): the model starts as its base LM.
        if isinstance(module, PartialLoRALinear):
            init.zeros_(module.Plora_B.weight)


class InternLMXComposer2TextModel(InternLMXComposer2PreTrainedModel):
    """The InternLM2 decoder (``model.*`` in the official state dict), without the output head."""

    config: InternLMXComposer2TextConfig
    input_modalities = ("text",)

    def __init__(self, config: InternLMXComposer2TextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [InternLMXComposer2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = InternLMXComposer2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = InternLMXComposer2RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.tok_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        im_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Run the decoder.

        Args:
            im_mask: [B, L] bool, true at image positions (Partial LoRA); ``None`` = all text.
            attention_mask: [B, L] (1 real / 0 pad). Leave it ``None`` for packed rows: the
                block-diagonal mask then comes from ``position_ids`` restarting at 0.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        # A cache only when asked for (generate() does): with one, transformers' mask
        # builder stops detecting packed rows, so a plain forward must not create it.
        use_cache = bool(use_cache)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        if im_mask is not None and im_mask.shape != inputs_embeds.shape[:-1]:
            raise ValueError(
                f"im_mask has shape {tuple(im_mask.shape)}, expected {tuple(inputs_embeds.shape[:-1])} (batch, length)"
            )

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                im_mask=im_mask,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


# -------------------------------------------------------------------------------------------------
# 4. Vision tower and the full model
# -------------------------------------------------------------------------------------------------


class InternLMXComposer2VisionTower(nn.Module):
    """``CLIPVisionModel`` under the official module path ``vit.vision_tower``.

    Features are the last encoder layer's outputs with CLS dropped, before the
    post-layernorm. That layernorm is never used, so it is replaced by ``Identity``:
    an unused parameter would break DDP (unused-parameter error) when the tower trains.
    """

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.vision_tower = CLIPVisionModel(config)
        self.vision_tower.post_layernorm = nn.Identity()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_tower(pixel_values=pixel_values).last_hidden_state[:, 1:]


class InternLMXComposer2ForCausalLM(InternLMXComposer2PreTrainedModel, GenerationMixin):
    """InternLM-XComposer2: ``vit`` (CLIP), ``vision_proj`` (MLP), ``model`` (InternLM2), ``output``.

    Module names match the official checkpoint's, so :func:`convert_official_state_dict`
    only has to strip CLIP's old ``vision_model.`` level and resize position embeddings.
    """

    def __init__(self, config: InternLMXComposer2Config):
        super().__init__(config)
        text, vision = config.text_config, config.vision_config
        self.vit = InternLMXComposer2VisionTower(vision)
        self.vision_proj = nn.Sequential(
            nn.Linear(vision.hidden_size, text.hidden_size), nn.GELU(), nn.Linear(text.hidden_size, text.hidden_size)
        )
        self.model = InternLMXComposer2TextModel(text)
        self.output = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.tok_embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        return self.output

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.output = value

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Project images: [N, 3, S, S] -> [N, num_image_tokens, hidden_size]."""
        vision = self.config.vision_config
        if pixel_values.ndim != 4 or pixel_values.shape[-2:] != (vision.image_size, vision.image_size):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                f"[num_images, {vision.num_channels}, {vision.image_size}, {vision.image_size}]"
            )
        dtype = self.vision_proj[0].weight.dtype
        return self.vision_proj(self.vit(pixel_values.to(dtype)))

    def _embed(
        self, input_ids: torch.LongTensor, pixel_values: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings with image features spliced in, and the image mask."""
        image_mask = input_ids == self.config.image_token_id
        # The image id sits outside the embedding table; look up row 0 there, then overwrite.
        inputs_embeds = self.model.tok_embeddings(input_ids.masked_fill(image_mask, 0))
        n_tokens = int(image_mask.sum())
        if pixel_values is None:
            if n_tokens:
                raise ValueError(
                    f"input_ids hold {n_tokens} image tokens (id {self.config.image_token_id}) but pixel_values is "
                    "None; pass the images the sequence refers to"
                )
            return inputs_embeds, image_mask
        features = self.get_image_features(pixel_values)
        n_features = features.shape[0] * features.shape[1]
        if n_tokens != n_features:
            raise ValueError(
                f"image tokens and image features do not match: {n_tokens} image tokens in input_ids, "
                f"{n_features} features ({features.shape[0]} images x {features.shape[1]} tokens)"
            )
        features = features.reshape(-1, features.shape[-1]).to(inputs_embeds.dtype)
        inputs_embeds = inputs_embeds.masked_scatter(image_mask.unsqueeze(-1), features)
        return inputs_embeds, image_mask

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        im_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Causal-LM forward over interleaved text and image tokens.

        Args:
            input_ids: [B, L]; each image is ``num_image_tokens`` copies of ``image_token_id``.
            pixel_values: [N_img, 3, S, S], images in the order their token runs appear (row-major).
            attention_mask: [B, L] or ``None`` (packed rows: ``position_ids`` restart per sample).
            position_ids: [B, L].
            inputs_embeds: instead of ``input_ids`` (then pass ``im_mask`` for Partial LoRA).
            im_mask: [B, L] bool; derived from ``input_ids`` when not given.
            labels: [B, L], -100 ignored; shifted inside the loss.

        Returns:
            ``CausalLMOutputWithPast`` with ``logits`` [B, L, vocab] (``loss`` when labels are given).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        kwargs.pop("num_loss_tokens", None)  # batch bookkeeping of the collator, not a model input
        if input_ids is not None:
            inputs_embeds, image_mask = self._embed(input_ids, pixel_values)
            im_mask = image_mask if im_mask is None else im_mask
        elif pixel_values is not None:
            raise ValueError("pixel_values needs input_ids (image positions are found by image_token_id)")
        outputs = self.model(
            inputs_embeds=inputs_embeds,
            im_mask=im_mask,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.output(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.text_config.vocab_size, **kwargs
            )
        result = CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
        if return_dict is False:
            return result.to_tuple()
        return result


# -------------------------------------------------------------------------------------------------
# 5. Official checkpoint conversion
# -------------------------------------------------------------------------------------------------


class CheckpointMismatchError(ValueError):
    """The converted state dict does not fit the native model (lists every problem)."""


# Official keys with no native counterpart: buffers recomputed at load time and CLIP's
# post-layernorm, which the feature path never uses.
_IGNORED_OFFICIAL_KEYS = (
    re.compile(r"\.rotary_emb\.inv_freq$"),
    re.compile(r"\.position_ids$"),
    re.compile(r"^vit\.vision_tower\.(vision_model\.)?post_layernorm\."),
)
_POSITION_EMBEDDING_KEY = "vit.vision_tower.embeddings.position_embedding.weight"


def _resize_position_embedding(weight: torch.Tensor, grid: int) -> torch.Tensor:
    """Bicubic resize of CLIP's patch position embeddings to ``grid x grid``; CLS kept.

    Same operation as the official code (align_corners False), done once at load time.
    """
    old_grid = int(round((weight.shape[0] - 1) ** 0.5))
    if old_grid * old_grid != weight.shape[0] - 1:
        raise CheckpointMismatchError(
            f"{_POSITION_EMBEDDING_KEY} has {weight.shape[0]} rows, which is not 1 + a square grid"
        )
    if old_grid == grid:
        return weight
    cls, patches = weight[:1], weight[1:]
    dtype = weight.dtype
    patches = patches.float().reshape(1, old_grid, old_grid, -1).permute(0, 3, 1, 2)
    patches = nn.functional.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(grid * grid, -1).to(dtype)
    return torch.cat([cls, patches], dim=0)


def convert_official_state_dict(
    state_dict: dict[str, torch.Tensor], config: InternLMXComposer2Config
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map official parameter names/shapes onto :class:`InternLMXComposer2ForCausalLM`.

    ``vit.vision_tower.vision_model.X`` becomes ``vit.vision_tower.X`` (transformers'
    ``CLIPVisionModel`` no longer has the ``vision_model`` level), CLIP position
    embeddings are resized to the configured grid, and recomputed buffers / the unused
    post-layernorm are dropped. All other names are the same.

    Returns:
        ``(converted, ignored_keys)``.
    """
    converted: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state_dict.items():
        if any(pattern.search(key) for pattern in _IGNORED_OFFICIAL_KEYS):
            ignored.append(key)
            continue
        converted[key.replace("vit.vision_tower.vision_model.", "vit.vision_tower.", 1)] = value
    if _POSITION_EMBEDDING_KEY in converted:
        grid = config.vision_config.image_size // config.vision_config.patch_size
        converted[_POSITION_EMBEDDING_KEY] = _resize_position_embedding(converted[_POSITION_EMBEDDING_KEY], grid)
    return converted, ignored


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointMismatchError` listing missing, unexpected and mis-shaped keys."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {expected[k]}"
        for k in sorted(set(expected) & set(state_dict))
        if tuple(state_dict[k].shape) != expected[k]
    ]
    if missing or unexpected or mismatched:
        lines = [f"the checkpoint {source} does not fit InternLMXComposer2ForCausalLM:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        lines.append(
            "  Check that the path holds an InternLM-XComposer2 (not 4KHD / 2.5) checkpoint and that "
            "model.image_size matches the variant (490 for -vl-7b, 224 for -7b)."
        )
        raise CheckpointMismatchError("\n".join(lines))


def load_official_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read every weight shard of a checkpoint directory (safetensors preferred, then .bin).

    Follows ``*.index.json`` when present. ``.bin`` files are memory-mapped and loaded
    with ``weights_only=True`` (no pickled code runs).
    """
    from safetensors.torch import load_file

    def shards(index_name: str, single: str, pattern: str) -> list[str]:
        index = os.path.join(path, index_name)
        if os.path.exists(index):
            with open(index) as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(path, f) for f in files]
        if os.path.exists(os.path.join(path, single)):
            return [os.path.join(path, single)]
        return sorted(glob.glob(os.path.join(path, pattern)))

    state_dict: dict[str, torch.Tensor] = {}
    files = shards("model.safetensors.index.json", "model.safetensors", "*.safetensors")
    if files:
        for file in files:
            state_dict.update(load_file(file))
        return state_dict
    files = shards("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")
    if not files:
        raise FileNotFoundError(
            f"no weights in {path}: expected model*.safetensors or pytorch_model*.bin (with or without an index json)"
        )
    for file in files:
        state_dict.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
    return state_dict


def native_config_from_official(
    official: dict[str, Any], *, image_size: int | None, plora_r: int | None = None
) -> InternLMXComposer2Config:
    """Build the native config from an official ``config.json`` dict.

    Args:
        official: the checkpoint's config.json (InternLM2 keys).
        image_size: vision input size (490 for -vl-7b, 224 for -7b); ``None`` reads the
            official ``img_size`` key when present.
        plora_r: Partial LoRA rank (read from ``Plora_A`` shapes by the loader).

    Raises:
        ValueError: the image size is not known.
    """
    size = image_size or official.get("img_size")
    if size is None:
        raise ValueError(
            "the official config does not say the image size; set model.image_size "
            "(490 for internlm-xcomposer2-vl-7b, 224 for internlm-xcomposer2-7b)"
        )
    rope = dict(official.get("rope_scaling") or {"type": "dynamic", "factor": 1.0})
    rope = {"rope_type": rope.get("rope_type", rope.get("type", "dynamic")), "factor": float(rope.get("factor", 1.0))}
    rope["rope_theta"] = float(official.get("rope_theta", _INTERNLM2_ROPE["rope_theta"]))
    text_keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
        "pad_token_id",
    )  # fmt: skip
    text = {k: official[k] for k in text_keys if k in official}
    text["rope_parameters"] = rope
    if plora_r is not None:
        # Official scaling is 1.0 (alpha 256 for r 256): keep alpha = r.
        text["plora_r"], text["plora_alpha"] = int(plora_r), float(plora_r)
    vision = dict(_CLIP_VIT_L_14, image_size=int(size))
    return InternLMXComposer2Config(text_config=text, vision_config=vision)


def _is_native_checkpoint(path: str) -> bool:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        return False
    with open(config_file) as handle:
        return json.load(handle).get("model_type") == InternLMXComposer2Config.model_type


def load_official_checkpoint(
    path: str,
    *,
    image_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> InternLMXComposer2ForCausalLM:
    """Build the native model from an official checkpoint directory (no remote code runs).

    Parameters are created on the meta device and the converted tensors assigned to
    them, so the 8.7B model is never initialised randomly first.

    Raises:
        CheckpointMismatchError: missing / unexpected / mis-shaped keys (all listed).
    """
    from accelerate import init_empty_weights

    with open(os.path.join(path, "config.json")) as handle:
        official = json.load(handle)
    raw = load_official_state_dict(path)
    plora = next((v.shape[0] for k, v in raw.items() if k.endswith(".Plora_A.weight")), None)
    config = native_config_from_official(official, image_size=image_size, plora_r=plora)
    config._attn_implementation = attn_implementation
    state_dict, _ignored = convert_official_state_dict(raw, config)
    with init_empty_weights(include_buffers=False):
        model = InternLMXComposer2ForCausalLM(config)
    check_state_dict(model, state_dict, path)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def convert_official_checkpoint(src: str, dst: str, *, image_size: int | None = None, dtype: str = "bfloat16") -> None:
    """Convert an official checkpoint directory to a native one (``save_pretrained`` + tokenizer files).

    The result loads with ``InternLMXComposer2ForCausalLM.from_pretrained(dst)`` and with
    ``ModelConfig(family="internlm_xcomposer2", path=dst)``.
    """
    model = load_official_checkpoint(src, image_size=image_size, dtype=getattr(torch, dtype))
    model.save_pretrained(dst)
    convert_official_tokenizer(src, dst)


def convert_official_tokenizer(src: str, dst: str) -> None:
    """Save the tokenizer of an official directory ``src`` into ``dst`` so that it loads
    without remote code and encodes as the official one: :class:`InternLM2Tokenizer` on
    its ``tokenizer.model`` (no remote-code class names in the saved config). A directory
    without ``tokenizer.model`` has its tokenizer files copied as they are."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    if os.path.isfile(os.path.join(src, "tokenizer.model")):
        _load_tokenizer(src, trust_remote_code=False).save_pretrained(dst)
        return
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens_map", "added_tokens")) and not name.endswith(".py"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


# -------------------------------------------------------------------------------------------------
# 6. Adapter
# -------------------------------------------------------------------------------------------------

#: Added special token whose id is ``image_token_id`` (decoding only; text never produces it).
IMAGE_TOKEN = "<ImageHere>"
_START, _END = "[UNUSED_TOKEN_146]", "[UNUSED_TOKEN_145]"
_TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", _END, _START)  # ids 0..4: unk 0, bos 1, eos 2 as InternLM2
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# An XC2-shaped model that builds on a CPU in well under a second: 2 decoder layers
# with grouped-query attention (4 query heads, 2 key/value groups) and a 2-layer CLIP
# seeing 56 px images in 14 px patches (16 image tokens per image). Partial LoRA keeps
# the official scaling of 1.0 (alpha = r). The vocabulary size comes from the tokenizer.
TINY_ARCHITECTURE: dict[str, Any] = {
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "plora_r": 8,
        "plora_alpha": 8.0,
        "plora_dropout": 0.05,
        "rope_parameters": {"rope_type": "dynamic", "factor": 1.0, "rope_theta": 1_000_000.0},
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
}


class InternLM2Tokenizer(SentencePieceBackend):
    """InternLM2's tokenizer without remote code: SentencePiece's own encoding of
    ``tokenizer.model`` (BPE with byte fallback and no dummy prefix), as the official slow
    tokenizer encodes. Converted fast tokenizers and ``LlamaTokenizer`` put a word marker
    ("▁") before separately encoded text, which changes role headers and answer starts.

    ``add_bos_token`` (default on) prepends ``<s>`` when ``add_special_tokens=True``;
    decoding goes through SentencePiece, so byte-fallback pieces become characters again.
    """

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        unk_token: str = "<unk>",
        bos_token: str = "<s>",
        eos_token: str = "</s>",
        pad_token: str = "</s>",
        add_bos_token: bool = True,
        add_eos_token: bool = False,
        **kwargs: Any,
    ):
        for key in ("legacy", "special_tokens_pattern", "auto_map", "tokenizer_class"):
            kwargs.pop(key, None)
        pattern = {(True, False): "bos", (False, True): "eos", (True, True): "bos_eos"}.get(
            (bool(add_bos_token), bool(add_eos_token)), "none"
        )
        super().__init__(
            vocab_file=vocab_file, unk_token=unk_token, bos_token=bos_token, eos_token=eos_token,
            pad_token=pad_token, legacy=True, special_tokens_pattern=pattern, **kwargs,
        )  # fmt: skip
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.init_kwargs.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp_model.decode_pieces(list(tokens))

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """SentencePiece ids of each text, no special tokens added (one batched call).
        Control-token strings in the text stay plain text; ``[UNUSED_TOKEN_*]`` strings are
        pieces of the model and become those tokens, as in the official tokenizer."""
        return self.sp_model.encode(list(texts)) if texts else []


def _load_tokenizer(path: str, trust_remote_code: bool):
    """The checkpoint's tokenizer without running its code where possible.

    Order: with ``trust_remote_code``, the checkpoint's own ``AutoTokenizer``; otherwise
    :class:`InternLM2Tokenizer` on its ``tokenizer.model`` (an official directory ships only
    that and remote code; a converted one the same file), then a fast ``tokenizer.json``.
    """
    from transformers import AutoTokenizer

    errors = []
    if trust_remote_code:
        try:
            return AutoTokenizer.from_pretrained(path, use_fast=False, trust_remote_code=True)
        except Exception as err:  # noqa: BLE001 - every failure is reported below
            errors.append(f"AutoTokenizer (remote code): {type(err).__name__}: {err}")
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        try:
            return InternLM2Tokenizer.from_pretrained(path)
        except Exception as err:  # noqa: BLE001
            errors.append(f"InternLM2Tokenizer(tokenizer.model): {type(err).__name__}: {err}")
    else:
        errors.append(f"no tokenizer.model in {path}")
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=True)
    except Exception as err:  # noqa: BLE001
        errors.append(f"AutoTokenizer: {type(err).__name__}: {err}")
    raise ValueError(
        f"cannot load the tokenizer of {path}:\n  " + "\n  ".join(errors) + "\n  An official InternLM-XComposer2 "
        "directory has the SentencePiece file tokenizer.model; copy it next to the weights (the sentencepiece and "
        "protobuf packages are mmtune dependencies)."
    )


def _strip_segments(segments) -> list:
    """A turn's segments with the turn's leading and trailing whitespace removed, as the
    official ``value.strip()`` on the text with its ``<ImageHere>`` placeholders does."""
    out = [s for s in segments if not isinstance(s, str) or s]
    while out and isinstance(out[0], str):
        out[0] = out[0].lstrip()
        if out[0]:
            break
        out.pop(0)
    while out and isinstance(out[-1], str):
        out[-1] = out[-1].rstrip()
        if out[-1]:
            break
        out.pop()
    return out


@register_adapter
class InternLMXComposer2Adapter(SquareImageAdapter, PieceAdapter):
    """InternLM-XComposer2 adapter (official fine-tuning format).

    Rendering (no system prompt in the official fine-tuning data)::

        <s>[UNUSED_TOKEN_146]user\\n{text with images}[UNUSED_TOKEN_145]\\n
        [UNUSED_TOKEN_146]assistant\\n{answer}[UNUSED_TOKEN_145]\\n ... </s>

    Ids and labels as the official fine-tuning code (``conv2text``, ``interleav_wrap``,
    ``mask_human_targets``): turn texts stripped; labels on each answer and its
    ``[UNUSED_TOKEN_145]``, and on the ``\\n`` and ``</s>`` after the last answer
    (``ModelConfig.label_final_eos``, default on as the official code). Images are spliced
    with no marker tokens; text is tokenized in the official parts (split at images and
    special tokens). Images are always resized to a square, as the official model does
    (``ModelConfig.image_aspect_ratio`` is not read).

    In ``encode_dialogue`` / ``encode_many`` a leading system turn wins over
    ``system_prompt``; the default is no system prompt, as in the official fine-tuning data.
    """

    family = "internlm_xcomposer2"
    default_lora_targets = ["wqkv", "wo", "w1", "w2", "w3"]
    #: official LoRA fine-tuning preset (peft ``LoraConfig`` keys)
    lora_preset: dict[str, Any] = {"r": 64, "lora_alpha": 64, "lora_dropout": 0.05}
    #: keeps LoRA off the vision tower and projector (their names never match anyway)
    lora_exclude_modules = r".*(vit|vision_proj).*"
    #: the official remote-code config of the VL variant (490 px, 1225 image tokens), so
    #: ``mmtune plan`` sizes it offline
    known_architectures = {
        "internlm/internlm-xcomposer2-vl-7b": {
            "model_type": "internlmxcomposer2", "vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
            "rope_scaling": {"type": "dynamic", "factor": 1.0}, "img_size": 490,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        },
    }

    def __init__(self, config: ModelConfig):
        self.config = config
        if config.path is None:
            arch = deep_update(TINY_ARCHITECTURE, config.architecture)
            vocab_size = int(arch["text_config"].pop("vocab_size", 512))
            # a copy: the image token is added below, and the cached tokenizer is shared
            tokenizer = copy.deepcopy(
                cached_tiny_tokenizer(
                    _TINY_SPECIAL_TOKENS,
                    vocab_size=vocab_size,
                    unk_token="<unk>",
                    bos_token="<s>",
                    eos_token="</s>",
                    pad_token="</s>",  # InternLM2 pads with eos
                )
            )
            arch["text_config"]["vocab_size"] = len(tokenizer)
            if config.image_size is not None:
                arch["vision_config"]["image_size"] = int(config.image_size)
            self.model_config = InternLMXComposer2Config(**arch)
            self._official = False
        else:
            if config.architecture:
                raise ValueError(
                    f"model.architecture is only used for random-weight models (model.path null); "
                    f"got {sorted(config.architecture)} with model.path={config.path!r}"
                )
            self._local_path = _resolve_path(config.path)
            tokenizer = _load_tokenizer(self._local_path, config.trust_remote_code)
            self._official = not _is_native_checkpoint(self._local_path)
            if self._official:
                with open(os.path.join(self._local_path, "config.json")) as handle:
                    self.model_config = native_config_from_official(json.load(handle), image_size=config.image_size)
            else:
                self.model_config = InternLMXComposer2Config.from_pretrained(self._local_path)
                size = self.model_config.vision_config.image_size
                if config.image_size is not None and config.image_size != size:
                    raise ValueError(
                        f"model.image_size={config.image_size} but the checkpoint {config.path} was converted for "
                        f"{size} px; leave model.image_size null or convert the official checkpoint again"
                    )
        self.image_token_id = int(self.model_config.image_token_id)
        if IMAGE_TOKEN not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        if tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != self.image_token_id:
            raise ValueError(
                f"{IMAGE_TOKEN} has id {tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)} in the tokenizer but the model "
                f"config's image_token_id is {self.image_token_id} (text vocab {self.model_config.text_config.vocab_size},"
                f" tokenizer {len(tokenizer)}); the tokenizer and checkpoint of {config.path} do not belong together"
            )
        self.tokenizer = tokenizer
        ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (_START, _END)}
        missing = [tok for tok, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing or tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer of {config.path} lacks {missing or ''} bos/eos tokens needed by the XC2 template"
            )
        self.start_id, self.end_id = int(ids[_START]), int(ids[_END])
        check_template_words(tokenizer, ("user", "assistant"), config.path)
        self._header_length = len(self._tokenize_many(["assistant\n"])[0])
        self.stop_token_ids = [int(tokenizer.eos_token_id), self.end_id]
        self.num_image_tokens = self.model_config.num_image_tokens
        self.image_size = self.model_config.vision_config.image_size
        # the official torchvision Resize on PIL inputs: a square bicubic resize, no crop
        self.image_transform = SquareImage(self.image_size)

    # -- saving / caching ---------------------------------------------------------------------
    def save_pretrained(self, directory: str) -> None:
        """Write the tokenizer next to a saved model, so ``ModelConfig(path=directory)`` reloads both."""
        self.tokenizer.save_pretrained(directory)

    def fingerprint(self) -> str:
        """A short hash of everything that changes encoded ids or lengths (for length caches)."""
        state = {
            "family": self.family,
            "path": self.config.path,
            "architecture": self.config.architecture,
            "image_size": self.image_size,
            "num_image_tokens": self.num_image_tokens,
            "vocab": len(self.tokenizer),
            "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
            "template": "xc2-v2",  # official stripping and parts
            "tokenizer_class": type(self.tokenizer).__name__,
        }
        return state_fingerprint(state)

    # -- rendering ----------------------------------------------------------------------------
    def _pieces(
        self, dialogue: "Dialogue", system_prompt: str | None, train_on: str, add_generation_prompt: bool
    ) -> Plan:
        # The official conv2text + interleav_wrap: every turn text stripped, then
        #   [146]user\n{text}[145]\n[146]assistant\n{answer}[145]\n ... </s>
        # tokenized in parts split at images and special tokens. The "\n" after each [145]
        # opens the next turn here (the same ids), so the one after the last kept answer
        # goes with the final </s> whatever truncation keeps.
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        system = system_prompt or ""
        if turns and turns[0].role == "system":
            if turns[0].images:
                raise ValueError(f"dialogue {dialogue.id!r}, turn 0: a system turn cannot hold images")
            system = turns[0].text
            turns = turns[1:]
        prefix = [Piece("ids", (int(self.tokenizer.bos_token_id),))]
        newline: list[Piece] = []  # "\n" before a turn's [146], after the first one
        if system:
            prefix += [Piece("ids", (self.start_id,)), Piece("text", "system\n" + system.strip()),
                       Piece("ids", (self.end_id,))]  # fmt: skip
            newline = [Piece("text", "\n")]
        last_assistant = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        rendered: list[tuple[str, list[Piece]]] = []
        for index, turn in enumerate(turns):
            if turn.role == "user":
                pieces = [*newline, Piece("ids", (self.start_id,))]
                text = "user\n"
                for segment in _strip_segments(turn.segments):
                    if isinstance(segment, Image):
                        pieces += [Piece("text", text), Piece("image", segment)]
                        text = ""
                    else:
                        text += segment
                pieces += [Piece("text", text), Piece("ids", (self.end_id,))]
            elif turn.role == "assistant":
                if turn.images:
                    raise ValueError(
                        f"dialogue {dialogue.id!r}, turn {index}: assistant turns cannot hold images in the "
                        "XComposer2 format; move the image into the user turn"
                    )
                trainable = train_on == "all_assistant" or index == last_assistant
                # official labels start 6 tokens after the user's [145]: "\n", [146] and the
                # first 3 tokens of "assistant\n{answer}" (the header, 3 tokens in
                # InternLM2's vocabulary) stay unlabelled
                pieces = [
                    *newline,
                    Piece("ids", (self.start_id,)),
                    Piece("text", "assistant\n" + turn.text.strip(), trainable, plain=self._header_length),
                    Piece("ids", (self.end_id,), trainable),
                ]
            else:
                raise ValueError(
                    f"dialogue {dialogue.id!r}, turn {index}: role {turn.role!r} is not allowed after the first "
                    "turn; only 'user' and 'assistant' alternate (a 'system' turn must come first)"
                )
            newline = [Piece("text", "\n")]
            rendered.append((turn.role, pieces))
        if add_generation_prompt:
            if not turns or turns[-1].role != "user":
                raise ValueError(f"dialogue {dialogue.id!r}: add_generation_prompt needs a final user turn")
            suffix = [*newline, Piece("ids", (self.start_id,)), Piece("text", "assistant\n")]
        else:
            ends_with_answer = bool(turns) and turns[-1].role == "assistant"
            label = ends_with_answer and self.config.label_final_eos
            suffix = [*[Piece("text", "\n", label) for _ in newline],
                      Piece("ids", (int(self.tokenizer.eos_token_id),), label)]  # fmt: skip
        return prefix, rendered, suffix

    def _tokenize_many(self, texts: list[str]) -> list[list[int]]:
        if isinstance(self.tokenizer, InternLM2Tokenizer):
            return self.tokenizer.encode_texts(texts)
        # split_special_tokens: control-token strings inside dialogue text stay plain text
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"] if texts else []

    # -- images -------------------------------------------------------------------------------
    def image_token_count(self, image: Image) -> int:
        # fixed for a square resize: never opens the file
        return self.num_image_tokens

    def normalize_uint8(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [..., 3, S, S] -> float32 pixel values normalised with CLIP mean / std, in the
        official order (torchvision's ``ToTensor`` then ``Normalize``: divide, subtract, divide)."""
        mean = torch.tensor(_CLIP_MEAN, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(_CLIP_STD, dtype=torch.float32).view(3, 1, 1)
        return (pixels.to(torch.float32) / 255.0 - mean) / std

    def preprocess_pil(self, images: list) -> torch.Tensor:
        """Official preprocessing of decoded PIL images: square bicubic resize (no crop), CLIP mean/std."""
        import numpy as np

        if not images:
            return torch.zeros(0, 3, self.image_size, self.image_size)
        return self.normalize_uint8(torch.from_numpy(np.stack([self.image_transform.from_pil(image) for image in images])))

    # -- model --------------------------------------------------------------------------------
    def load_model(self, **kwargs: Any) -> nn.Module:
        """Load the checkpoint (native or official) or build the random-weight model (``path`` None).

        Keyword arguments: ``torch_dtype`` / ``attn_implementation`` (default from the
        ModelConfig), ``seed`` (random-weight model only); others go to ``from_pretrained``
        of a native checkpoint.
        """
        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        seed = kwargs.pop("seed", 0)
        if kwargs.get("quantization_config") is not None:
            raise NotImplementedError(
                "4-bit/8-bit loading (peft.method=qlora) is not supported for InternLM-XComposer2: bitsandbytes "
                "would replace the Partial LoRA layers (wqkv/wo/w1/w2/w3) with quantized layers that have no "
                "image-token branch. Use peft.method=lora."
            )
        if self.config.path is None:
            return build_random_model(
                InternLMXComposer2ForCausalLM, self.model_config, seed=seed, attn_implementation=attn, dtype=dtype
            )
        if self._official:
            model = load_official_checkpoint(
                self._local_path, image_size=self.image_size, dtype=dtype, attn_implementation=attn
            )
            self.model_config = model.config
            return model
        return InternLMXComposer2ForCausalLM.from_pretrained(
            self._local_path, dtype=dtype, attn_implementation=attn, **kwargs
        )

    @classmethod
    def meta_model(cls, config: ModelConfig, checkpoint_config: dict[str, Any] | None) -> tuple[nn.Module, ModuleGroups]:
        """A native or an official checkpoint's model on the meta device (see the base class);
        an official config gets Partial LoRA rank 256, as in the released weights."""
        if checkpoint_config is None:
            return super().meta_model(config, checkpoint_config)
        if checkpoint_config.get("model_type") == InternLMXComposer2Config.model_type:
            model_config = InternLMXComposer2Config.from_dict(checkpoint_config)
        else:  # the official remote-code config
            model_config = native_config_from_official(checkpoint_config, image_size=config.image_size, plora_r=256)
        with torch.device("meta"):
            model = InternLMXComposer2ForCausalLM(model_config)
        return model, _module_groups(model)

    def module_groups(self, model: nn.Module) -> ModuleGroups:
        return _module_groups(unwrap_model(model, InternLMXComposer2ForCausalLM))

    def loss_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The InternLM2 decoder (``model``, output normed) and the output head (``output``)."""
        inner = unwrap_model(model, InternLMXComposer2ForCausalLM)
        return inner.model, inner.output

    def text_config(self, config: Any) -> Any:
        return getattr(config, "text_config", config)

    def vision_dummy_loss(self, model: nn.Module) -> torch.Tensor:
        """Run the vision tower and projector on one blank image and return 0 * their output.

        Exactly zero, but autograd reaches every vision/projector parameter, so they get
        zero (not None) gradients and every rank calls the same modules (ZeRO-3).
        """
        inner = unwrap_model(model, InternLMXComposer2ForCausalLM)
        vision = inner.config.vision_config
        param = inner.vision_proj[0].weight
        pixel_values = torch.zeros(
            1, vision.num_channels, vision.image_size, vision.image_size, dtype=param.dtype, device=param.device
        )
        return inner.get_image_features(pixel_values).sum() * 0.0


def _module_groups(model: InternLMXComposer2ForCausalLM) -> ModuleGroups:
    return ModuleGroups(vision=[model.vit], projector=[model.vision_proj], language_model=[model.model, model.output])


def _resolve_path(path: str) -> str:
    """A local directory for ``path`` (a directory, or a hub id resolved through the local cache)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.model", "*.safetensors", "*.bin", "*.txt"])
    except Exception as err:  # noqa: BLE001
        raise FileNotFoundError(
            f"model.path={path!r} is not a local directory and could not be fetched from the hub ({err}); "
            "download the checkpoint and point model.path at the directory"
        ) from err


def _register_auto_classes() -> None:
    # So AutoConfig / AutoModelForCausalLM open checkpoints saved by this module (e.g. in peft tooling).
    from transformers import AutoConfig, AutoModelForCausalLM

    for config_cls in (InternLMXComposer2TextConfig, InternLMXComposer2Config):
        try:
            AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        except (TypeError, ValueError):  # pragma: no cover - older transformers signature
            pass
    try:
        AutoModelForCausalLM.register(InternLMXComposer2Config, InternLMXComposer2ForCausalLM, exist_ok=True)
    except (TypeError, ValueError):  # pragma: no cover
        pass


_register_auto_classes()
