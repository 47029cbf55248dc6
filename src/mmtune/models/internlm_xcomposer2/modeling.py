"""InternLM-XComposer2's model on transformers building blocks, in reading order:

* :class:`PartialLoRALinear` (a linear layer whose low-rank branch only touches image tokens);
* the InternLM2 decoder (fused ``wqkv`` attention, SwiGLU, RMSNorm, rotary);
* the vision tower wrapper and :class:`InternLMXComposer2ForCausalLM`.

Importing this module registers the configs and the model with ``AutoConfig`` /
``AutoModelForCausalLM``, so checkpoints saved by it open through transformers' Auto classes.
"""

# No `from __future__ import annotations`: transformers reads `config: <ConfigClass>` annotations at run time.

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from mmtune.models.internlm_xcomposer2.configuration import InternLMXComposer2Config, InternLMXComposer2TextConfig

__all__ = [
    "PartialLoRALinear",
    "InternLMXComposer2Attention",
    "InternLMXComposer2DecoderLayer",
    "InternLMXComposer2PreTrainedModel",
    "InternLMXComposer2TextModel",
    "InternLMXComposer2VisionTower",
    "InternLMXComposer2ForCausalLM",
]


# -------------------------------------------------------------------------------------------------
# Partial LoRA
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
# InternLM2 decoder
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
# Vision tower and the full model
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
