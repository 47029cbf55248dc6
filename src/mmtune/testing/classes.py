"""Tested classes as one entry each: a :class:`~mmtune.testing.kind.TinyKind` with the builders of
its processor and config, written after the released checkpoint (or transformers' conversion)
named in ``released``. :data:`mmtune.testing.checkpoints.KINDS` holds these after the classes of
:mod:`mmtune.testing.classes_first`; tests, ``scripts/tiny_checkpoint.py`` and ``bench/collate.py``
read that one mapping.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mmtune.models.qwen2_vl.template import QWEN2_VL_CHAT_TEMPLATE
from mmtune.testing.classes_first import _AYA_VISION_TEMPLATE, FIRST, _glm4v_config, glm_vision_processor
from mmtune.testing.kind import TinyKind

__all__ = ["CLASSES"]

_SMALL_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 4096}  # fmt: skip

# -- Janus (deepseek-ai/Janus-Pro-1B as transformers' convert_janus_weights_to_hf.py writes it) ------
# the conversion's CHAT_TEMPLATE, and its processor saved with use_default_system_prompt=True
_JANUS_TEMPLATE = (
    "{%set seps=['\n\n','<\uff5cend\u2581of\u2581sentence\uff5c>']%}"
    "{%set i=0%}"
    "{%for message in messages%}"
    "{%if message['role']|lower=='user'%}"
    "<|User|>: "
    "{%elif message['role']|lower=='assistant'%}"
    "<|Assistant|>:{%if not (loop.last and not add_generation_prompt and message['content'][0]['type']=='text' and message['content'][0]['text']=='')%} {%endif%}"
    "{%else%}"
    "{{message['role'].capitalize()}}: "
    "{%endif%}"
    "{%for content in message['content']%}"
    "{%if content['type']=='image'%}"
    "{%if not loop.first%}{{'\n'}}{%endif%}"
    "<image_placeholder>"
    "{%if not loop.last%}{{'\n'}}{%endif%}"
    "{%elif content['type']=='text'%}"
    "{%set text=content['text']%}"
    "{%if loop.first%}{%set text=text.lstrip()%}{%endif%}"
    "{%if loop.last%}{%set text=text.rstrip()%}{%endif%}"
    "{%if not loop.first and message['content'][loop.index0-1]['type']=='text'%}"
    "{{' '+text}}"
    "{%else%}"
    "{{text}}"
    "{%endif%}"
    "{%endif%}"
    "{%endfor%}"
    "{%if not loop.last or add_generation_prompt%}"
    "{%if message['role']|lower=='user'%}"
    "{{seps[0]}}"
    "{%else%}"
    "{{seps[1]}}"
    "{%endif%}"
    "{%endif%}"
    "{%endfor%}"
    "{%if add_generation_prompt%}<|Assistant|>:{%endif%}"
)
_BOS, _EOS, _PAD = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5c\u2581pad\u2581\uff5c>"


def _janus_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import JanusProcessor
    from transformers.models.janus.image_processing_janus import JanusImageProcessor

    size = released["size"] if released else 32
    tokens = released["num_image_tokens"] if released else 4
    return JanusProcessor(image_processor=JanusImageProcessor(size={"height": size, "width": size}),
                          tokenizer=tokenizer, chat_template=template, use_default_system_prompt=True,
                          num_image_tokens=tokens)  # fmt: skip


def _janus_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, "model_type": "llama"},
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
                              "patch_size": 16, "projection_dim": 64, "num_image_tokens": 4},
            # the image-generation VQ model, as small as its group norms (32 groups) allow
            "vq_config": {"embed_dim": 8, "num_embeddings": 32, "latent_channels": 32, "base_channels": 32,
                          "channel_multiplier": [1, 1], "num_res_blocks": 1, "num_patches": 2, "projection_dim": 64,
                          "image_token_embed_dim": 64},
            "image_token_id": tokenizer.convert_tokens_to_ids("<image_placeholder>")}  # fmt: skip


# -- Llama 4 (meta-llama/Llama-4-Scout-17B-16E-Instruct) -----------------------------------------------
# BOS, "<|header_start|>role<|header_end|>\n\n" headers, "<|eot|>" ends a turn, "<|image|>" per image item
_LLAMA4_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}{%- elif content['type'] == 'text' %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|eot|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"
)


def _llama4_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Llama4ImageProcessor, Llama4Processor

    size = released["size"] if released else 28
    image = Llama4ImageProcessor(size={"height": size, "width": size},
                                 max_patches=released["max_patches"] if released else 4)  # fmt: skip
    # its image processor returns bfloat16 pixel_values, as the released one does
    return Llama4Processor(image_processor=image, tokenizer=tokenizer, patch_size=14, pixel_shuffle_ratio=0.5,
                           chat_template=template)  # fmt: skip


def _llama4_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    return {"text_config": {**text, "intermediate_size": 64, "intermediate_size_mlp": 128, "head_dim": 16,
                            # mixture of experts in every second layer (the released Scout: every layer)
                            "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                            "attention_chunk_size": 8192},  # the released value
            # the pixel shuffle makes 4 x hidden_size features (the vision MLP's input: intermediate_size)
            "vision_config": {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_output_dim": 64,
                              "projector_input_dim": 64, "projector_output_dim": 64, "pixel_shuffle_ratio": 0.5},
            "boi_token_index": ids("<|image_start|>"), "eoi_token_index": ids("<|image_end|>"),
            "image_token_index": ids("<|patch|>")}  # fmt: skip


# -- HunYuan-VL (tencent/HunyuanOCR) ------------------------------------------------------------------
# BOS, the system text ended by a placeholder token, "<｜hy_User｜>" / "<｜hy_Assistant｜>" turns, an answer
# ended by EOS, each image wrapped in its start / end tokens (what HunYuanVLProcessor requires around it)
def _hy(name: str) -> str:
    return "<\uff5chy_" + name.replace(" ", "\u2581") + "\uff5c>"


_HY_BOS, _HY_EOS, _HY_PAD = _hy("begin of sentence"), _hy("place holder no 2"), _hy(" pad ")
_HY_IMAGE = {"image_start_token": _hy("place holder no 100"), "image_token": _hy("place holder no 102"),
             "image_end_token": _hy("place holder no 101")}  # fmt: skip
_HY_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- for item in message['content'] %}{{- item['text'] }}{%- endfor %}"
    "{{- '" + _hy("place holder no 3") + "' }}"
    "{%- elif message['role'] == 'user' %}{{- '" + _hy("User") + "' }}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '" + _HY_IMAGE["image_start_token"] + _HY_IMAGE["image_token"]
    + _HY_IMAGE["image_end_token"] + "' }}{%- else %}{{- item['text'] }}{%- endif %}{%- endfor %}"
    "{%- else %}{{- '" + _hy("Assistant") + "' }}{%- for item in message['content'] %}{{- item['text'] }}{%- endfor %}"
    "{{- eos_token }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '" + _hy("Assistant") + "' }}"
    "{%- endif %}"
)


def _hunyuan_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers.models.hunyuan_vl.image_processing_hunyuan_vl import HunYuanVLImageProcessor
    from transformers.models.hunyuan_vl.processing_hunyuan_vl import HunYuanVLProcessor

    low, high = (released["min_pixels"], released["max_pixels"]) if released else (32 * 32 * 4, 32 * 32 * 32)
    image = HunYuanVLImageProcessor(size={"shortest_edge": low, "longest_edge": high}, patch_size=16, merge_size=2)
    return HunYuanVLProcessor(image_processor=image, tokenizer=tokenizer, chat_template=template)


def _hunyuan_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    # four rope axes (sequence, width, height, image index) of 2 half-dimensions each, as the released 4 x 16
    return {"text_config": {**text, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                         "mrope_section": [2, 2, 2, 2]}},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                              "out_hidden_size": 64, "text_hidden_size": 64},
            "image_token_id": ids(_HY_IMAGE["image_token"]), "im_start_id": ids(_HY_IMAGE["image_start_token"]),
            "im_end_id": ids(_HY_IMAGE["image_end_token"]), "im_newline_id": ids(_hy("place holder no 103"))}


# -- Qwen3.5 (Qwen/Qwen3.5-*: Qwen3_5ForConditionalGeneration, Qwen3VLProcessor) -------------------------
# The logic of its released chat template, reduced to images and text: ChatML turns; an answer after
# the last user turn is written with its thinking block ("<think>\n\n</think>\n\n" when it has none),
# earlier answers without it (so the template is not prefix-stable); the generation prompt opens the
# thinking block ("<think>\n"). ``{GEN}`` / ``{END}`` mark where the fidelity tests' copy puts
# ``{% generation %}`` tags (transformers' assistant mask is their reference for the labels).
_QWEN35_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = namespace(text='') %}"
    "{%- for item in message['content'] %}{%- if item['type'] == 'image' %}"
    "{%- set content.text = content.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif item['type'] == 'text' %}{%- set content.text = content.text + item['text'] %}{%- endif %}{%- endfor %}"
    "{%- if message['role'] == 'assistant' %}{%- set reasoning = '' %}{%- set answer = content.text %}"
    "{%- if '</think>' in answer %}"
    "{%- set reasoning = answer.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}{GEN}"
    "{{- '\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + answer.lstrip('\\n') + '<|im_end|>\\n' }}{END}"
    "{%- else %}{{- '<|im_start|>assistant\\n' }}{GEN}{{- answer + '<|im_end|>\\n' }}{END}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content.text + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>", "<think>", "</think>")  # fmt: skip


def _qwen_vl_processor(processor_class: Any, video_class: Any, patch: int, tokenizer: Any, template: str,
                       released: dict[str, Any] | None) -> Any:
    """A Qwen-VL-line processor: the PIL image processor on ``patch`` px patches merged 2 x 2, at the
    tiny pixel bounds (4 to 64 image tokens) or the released ones."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch * 2
    low, high = (released["min_pixels"], released["max_pixels"]) if released else (4 * factor**2, 64 * factor**2)
    image = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=low,
                                     max_pixels=high)  # fmt: skip
    return processor_class(image_processor=image, tokenizer=tokenizer, video_processor=video_class(),
                           chat_template=template)  # fmt: skip


def _qwen3vl_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return _qwen_vl_processor(Qwen3VLProcessor, Qwen3VLVideoProcessor, 16, tokenizer, template, released)


def _qwen3vl_vision() -> dict[str, Any]:
    return {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0]}  # fmt: skip


def _qwen_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {"image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
            "vision_start_token_id": ids("<|vision_start|>"), "vision_end_token_id": ids("<|vision_end|>")}


_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
# one linear-attention (Gated DeltaNet) layer and one full-attention layer, as the released 3:1 pattern mixes them
_QWEN35_TEXT = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "rope_parameters": {**_MROPE, "partial_rotary_factor": 1.0}}
_MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def _qwen35_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, **_QWEN35_TEXT}, "vision_config": _qwen3vl_vision(), **_qwen_ids(tokenizer)}


def _qwen35_moe_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, **_QWEN35_TEXT, **_MOE, "shared_expert_intermediate_size": 32},
            "vision_config": _qwen3vl_vision(), **_qwen_ids(tokenizer)}


def _qwen3vl_moe_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, **_MOE, "head_dim": 16, "rope_parameters": _MROPE, "decoder_sparse_step": 1},
            "vision_config": _qwen3vl_vision(), **_qwen_ids(tokenizer)}


def _qwen_kind(model_type: str, template: str, released: str, config: Any, tagged: str | None = None) -> TinyKind:
    return TinyKind(model_type, template, released, _QWEN_SPECIAL, add_bos=False,
                    named_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
                    processor=_qwen3vl_processor, config=config,
                    released_sizes={"min_pixels": 64 * 32**2, "max_pixels": 16384 * 32**2},
                    fidelity_reference_template=tagged, projector_in_vision=True)


# -- Qwen4-Exp (Qwen4ExpForConditionalGeneration, Qwen3VLProcessor): Qwen3.5-MoE's layout with
# hyper-connections, per-layer n-gram embeddings (PLE) and QSA-indexed full attention; its template
# logic is Qwen3.5's
_QWEN4_EXP_TEXT = {"hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 16, "ngram_size": 3,
                   "heads_per_ngram": 2, "ngram_vocab_size_base": 1000, "make_ngram_vocab_size_divisible_by": 8,
                   "split_ngram_parts": 1, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                   "indexer_budget": 16, "indexer_compress_ratio": 4, "output_gate_type": "sigmoid"}  # fmt: skip


def _qwen4_exp_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    layers = {"layer_types": ["linear_attention", "indexed_attention"]}
    return {"text_config": {**text, **_QWEN35_TEXT, **_MOE, "shared_expert_intermediate_size": 32, **_QWEN4_EXP_TEXT,
                            **layers},
            "vision_config": _qwen3vl_vision(), **_qwen_ids(tokenizer)}


# -- Qwen2.5-VL on the auto path (Qwen/Qwen2.5-VL-*-Instruct: the released ChatML template, which the
# qwen2_vl family encodes after the official fine-tuning code instead)
def _qwen25vl_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return _qwen_vl_processor(Qwen2_5_VLProcessor, Qwen2VLVideoProcessor, 14, tokenizer, template, released)


def _qwen25vl_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "window_size": 56,
              "fullatt_block_indexes": [1]}  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    return {"text_config": {**text, "head_dim": 16, "rope_parameters": rope}, "vision_config": vision,
            **_qwen_ids(tokenizer)}


# -- LFM2-VL (LiquidAI/LFM2-VL-1.6B): ChatML after the tokenizer's BOS; images as tiles of 512 px in a row /
# column grid with a thumbnail; its language model mixes short-convolution and attention layers
_LFM2_VL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<image>' }}{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
_LFM2_VL_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>") + tuple(
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11))


def _lfm2_vl_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    values = released or {"tile_size": 64, "min_image_tokens": 4, "max_image_tokens": 16, "max_tiles": 4}
    image = Lfm2VlImageProcessor(tile_size=values["tile_size"], size={"height": values["tile_size"],
                                 "width": values["tile_size"]}, min_image_tokens=values["min_image_tokens"],
                                 max_image_tokens=values["max_image_tokens"], max_tiles=values["max_tiles"])
    return Lfm2VlProcessor(image_processor=image, tokenizer=tokenizer, chat_template=template)


def _lfm2_vl_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, "model_type": "lfm2", "layer_types": ["conv", "full_attention"],
                            "block_auto_adjust_ff_dim": False},
            "vision_config": {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 16, "num_patches": 64},
            "image_token_id": tokenizer.convert_tokens_to_ids("<image>"), "projector_hidden_size": 64}


# -- Kimi K2.5 (moonshotai/Kimi-K2.5: Kimi_K25ForConditionalGeneration, a DeepSeek-V3 text model with
# multi-head latent attention and experts): its turn markers, an image as
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|>; the thinking parts left out
_KIMI_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{- '<|im_system|>system<|im_middle|>' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|im_user|>user<|im_middle|>' }}"
    "{%- else %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' }}"
    "{%- else %}{{- item['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)
_KIMI_TOKENS = ("[BOS]", "[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                "<|im_end|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                "<|kimi_k25_video_placeholder|>")


def _kimi_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    side, patches = (released["max_side"], released["max_patches"]) if released else (112, 64)
    image = Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side}, max_patches=patches)
    return Kimi_K25Processor(image_processor=image, tokenizer=tokenizer, video_processor=Kimi_K25VideoProcessor(),
                             chat_template=template)


def _kimi_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    latent = {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
              "topk_group": 1}
    return {"text_config": {**text, "model_type": "deepseek_v3", **latent},
            "vision_config": {"patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_size": 32,
                              "intermediate_size": 64, "pos_emb_height": 16, "pos_emb_width": 16},
            "projection_hidden_size": 32, "image_token_id": ids("<|media_pad|>"),
            "video_token_id": ids("<|kimi_k25_video_placeholder|>"), "vision_start_token_id": ids("<|media_begin|>"),
            "vision_end_token_id": ids("<|media_end|>")}


# -- MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration: a Qwen3.5 text model): ChatML turns; its processor
# numbers the images of a call in their text (<image_id_start_token>k<image_id_end_token>) and slices them
_MINICPM_NAMED = {name: f"<{name}>" for name in ("image_start_token", "image_end_token", "image_id_start_token",
                                                 "image_id_end_token", "slice_start_token", "slice_end_token",
                                                 "video_token")}


def _minicpm_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import MiniCPMV4_6ImageProcessor, MiniCPMV4_6Processor, MiniCPMV4_6VideoProcessor

    values = released or {"scale_resolution": 112, "max_slice_nums": 2}
    image = MiniCPMV4_6ImageProcessor(scale_resolution=values["scale_resolution"],
                                      max_slice_nums=values["max_slice_nums"])
    return MiniCPMV4_6Processor(image_processor=image, tokenizer=tokenizer, video_processor=MiniCPMV4_6VideoProcessor(),
                                chat_template=template)  # fmt: skip


def _minicpm_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": {**text, **_QWEN35_TEXT, "model_type": "qwen3_5_text"},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "patch_size": 14, "image_size": 112, "insert_layer_id": 0},
            "image_size": 112, "insert_layer_id": 0, "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
            "video_token_id": tokenizer.convert_tokens_to_ids("<video_token>")}


# -- Command A Vision (CohereLabs/command-a-vision-07-2025: Cohere2VisionForConditionalGeneration): Aya
# Vision's turns, each image item as the processor's <|IMG_PATCH|> (tiles of patches and line breaks)
_COHERE2_VISION_TEMPLATE = _AYA_VISION_TEMPLATE.replace("{{ '<image>' }}", "{{ '<|IMG_PATCH|>' }}")


def _cohere2_vision_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Cohere2VisionImageProcessor, Cohere2VisionProcessor

    values = released or {"size": 56, "max_patches": 4, "patch_size": 2}
    image = Cohere2VisionImageProcessor(size={"height": values["size"], "width": values["size"]},
                                        max_patches=values["max_patches"], patch_size=values["patch_size"])
    return Cohere2VisionProcessor(image_processor=image, tokenizer=tokenizer, chat_template=template)


def _cohere2_vision_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
            "text_config": {**text, "model_type": "cohere2", "head_dim": 16, "sliding_window": 16,
                            "layer_types": ["sliding_attention", "full_attention"]},
            "image_token_id": tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"), "downsample_factor": 2,
            "alignment_intermediate_size": 64}


# -- Molmo2 (allenai/Molmo2-4B) ----------------------------------------------------------------------
# ChatML turns, "<|image|>" per image item; no BOS in the template: its processor's call adds it
_MOLMO2_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- for item in message['content'] %}{%- if item['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- else %}{{- item['text'] }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_MOLMO2_IMAGE_TOKENS = ("<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>",
                        "<frame_end>", "<im_low>", "<|image|>", "<|video|>")


def _molmo2_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers.models.molmo2.image_processing_molmo2 import Molmo2ImageProcessor
    from transformers.models.molmo2.processing_molmo2 import Molmo2Processor
    from transformers.models.molmo2.video_processing_molmo2 import Molmo2VideoProcessor

    size = released["size"] if released else 56
    image = Molmo2ImageProcessor(size={"height": size, "width": size}, max_crops=released["max_crops"] if released else 2,
                                 patch_size=14, pooling_size=[2, 2], overlap_margins=[4, 4] if released else [1, 1])
    return Molmo2Processor(image_processor=image, video_processor=Molmo2VideoProcessor(size={"height": size, "width": size}),
                           tokenizer=tokenizer, chat_template=template)  # fmt: skip


def _molmo2_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    return {"text_config": {**text, "head_dim": 16, "additional_vocab_size": 0},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "image_size": [56, 56],
                              "patch_size": 14},
            "adapter_config": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                               "intermediate_size": 64, "text_hidden_size": 64, "vision_feature_layer": [-1]},
            "image_start_token_id": ids("<im_start>"), "low_res_image_start_token_id": ids("<low_res_im_start>"),
            "image_end_token_id": ids("<im_end>"), "image_patch_id": ids("<im_patch>"),
            "frame_start_token_id": ids("<frame_start>"), "frame_end_token_id": ids("<frame_end>")}  # fmt: skip


# -- Step3p7 (stepfun-ai/Step-3.7-Flash: Step3p7ForConditionalGeneration): a global view per image and local
# crops for images far from its shape, whose input (pixel_values_local) the processor leaves out for an image
# without crops; MoE text model
_STEP3P7_TEMPLATE = _MOLMO2_TEMPLATE.replace("<|image|>", "<im_patch>")


def _step3p7_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Step3p7ImageProcessor, Step3p7Processor

    size, crop = (released["size"], released["crop"]) if released else (112, 56)
    image = Step3p7ImageProcessor(size={"height": size, "width": size}, patch_size=crop)
    return Step3p7Processor(image, tokenizer, chat_template=template)


def _step3p7_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    experts = {"moe_intermediate_size": 32, "share_expert_dim": 32, "num_experts_per_tok": 2, "n_routed_experts": 4,
               "num_local_experts": 4, "mlp_layer_types": ["dense", "sparse"]}
    # one sliding-window and one full-attention layer (its model builds both masks whatever the layers)
    return {"text_config": {**text, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
                            "sliding_window": 16, **experts},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "image_size": 112, "patch_size": 14,
                              "max_position_embeddings": 64, "mlp_ratio": 2.0},
            "image_token_id": tokenizer.convert_tokens_to_ids("<im_patch>")}


# -- Gemma 4 (google/gemma-4-E4B-it; transformers' convert_gemma4_weights.py for tokens and sizes) -------
# BOS written by the template (the released tokenizer adds none); a leading system message as its own
# "<|turn>system\n...<turn|>\n" turn; "<|turn>role\n" headers with "assistant" written "model", each
# turn ended by "<turn|>\n"; text items trimmed, "<|image|>" per image item (the processor wraps it
# in "<|image>" / "<image|>"); the generation prompt "<|turn>model\n"
_GEMMA4_TEMPLATE = (
    "{{- bos_token -}}{%- set loop_messages = messages -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}{{- '<|turn>system\\n' -}}"
    "{%- if messages[0]['content'] is string -%}{{- messages[0]['content'] | trim -}}"
    "{%- else -%}{%- for item in messages[0]['content'] -%}{{- item['text'] | trim -}}{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\\n' -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<|image|>' -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)
_GEMMA4_NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}  # fmt: skip


def _gemma4_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessor, Gemma4Processor, Gemma4VideoProcessor

    # the fewest soft tokens the image processor allows (70: 64 for a square image), on 4 px patches
    values = released or {"patch_size": 4, "max_soft_tokens": 70}
    tokens = values["max_soft_tokens"]
    image = Gemma4ImageProcessor(patch_size=values["patch_size"], max_soft_tokens=tokens, pooling_kernel_size=3,
                                 do_normalize=False)  # fmt: skip
    # the processor refuses to start without its audio and video parts; they take no part here
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image,
                           tokenizer=tokenizer, video_processor=Gemma4VideoProcessor(), image_seq_length=tokens,
                           chat_template=template)  # fmt: skip


def _gemma4_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    # the E-series text model: per-layer input embeddings (narrowed to 16), a sliding-window layer then
    # a full one (partial "proportional" rope), logit soft-capping; no shared KV layers in 2 layers
    return {"text_config": {**text, "head_dim": 16, "global_head_dim": 16, "sliding_window": 16,
                            "layer_types": ["sliding_attention", "full_attention"],
                            "vocab_size_per_layer_input": text["vocab_size"], "hidden_size_per_layer_input": 16,
                            "num_kv_shared_layers": 0, "final_logit_softcapping": 30.0},
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4,
                              "pooling_kernel_size": 3, "position_embedding_size": 64},
            "image_token_id": ids("<|image|>"), "boi_token_id": ids("<|image>"), "eoi_token_id": ids("<image|>"),
            "video_token_id": ids("<|video|>"), "audio_token_id": ids("<|audio|>"), "boa_token_id": ids("<|audio>"),
            "eoa_token_index": ids("<audio|>")}  # fmt: skip


# -- GLM-4.5V (zai-org/GLM-4.5V: Glm4vMoeForConditionalGeneration, Glm4vProcessor): GLM-4.1V's images and
# GLM-4.6V's template logic (below), its own text model of experts
def _glm45v_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    config = _glm4v_config(tokenizer, text)
    experts = {"moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    # the released rotary factor 0.5: M-RoPE splits the 4 rotary half-dimensions of a 16-wide head
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
    return {**config, "text_config": {**config["text_config"], **experts, "rope_parameters": rope}}


# -- GLM-4.6V (zai-org/GLM-4.6V: Glm46VProcessor; its text model GLM-4.5-Air's mixture of experts) -----
# The logic of the GLM-4.5V / 4.6V template, reduced to images and text: "[gMASK]<sop>", "<|role|>\n"
# headers (an answer's header "<|assistant|>" without the newline), images in begin / end markers;
# every answer written after a thinking block ("\n<think></think>" when it has none; its own reasoning
# kept only after the last user turn) and then "\n" and its stripped text; no stop token after an
# answer (the next turn's "<|user|>" is one of the generation config's stops). The generation prompt
# is "<|assistant|>\n"; enable_thinking=false adds "/nothink" to user turns and "<think></think>\n" to it.
_GLM46V_TEMPLATE = (
    "[gMASK]<sop>{%- set ns = namespace(last_user_index=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set visible = namespace(text='') %}"
    "{%- if m['content'] is string %}{%- set visible.text = m['content'] %}{%- else %}"
    "{%- for item in m['content'] %}{%- if item['type'] == 'text' %}"
    "{%- set visible.text = visible.text + item['text'] %}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if m['role'] == 'user' %}{{- '<|user|>\\n' }}"
    "{%- if m['content'] is string %}{{- m['content'] }}{%- else %}{%- for item in m['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if enable_thinking is defined and not enable_thinking and not visible.text.endswith('/nothink') %}"
    "{{- '/nothink' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|assistant|>' }}{%- set reasoning = '' %}"
    "{%- set content = visible.text %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user_index and reasoning %}{{- '\\n<think>' + reasoning.strip() + '</think>' }}"
    "{%- else %}{{- '\\n<think></think>' }}{%- endif %}"
    "{%- if content.strip() %}{{- '\\n' + content.strip() }}{%- endif %}"
    "{%- elif m['role'] == 'system' %}{{- '<|system|>\\n' + visible.text }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think></think>\\n' }}{%- endif %}{%- endif %}"
)


def _glm46v_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Glm46VImageProcessor, Glm46VProcessor, Glm46VVideoProcessor

    return glm_vision_processor((Glm46VImageProcessor, Glm46VProcessor, Glm46VVideoProcessor), tokenizer, template,
                                released)


def _glm46v_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    config = _glm4v_config(tokenizer, text)
    # GLM-4.5-Air's text model: half of each head rotary (M-RoPE sections in the released 8:12:12), a
    # dense first layer, then routed experts with a shared one (the released: 128 routed, 8 a token, 1 shared)
    config["text_config"] = {**text, "model_type": "glm4v_moe_text", "head_dim": 32,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5},
                             "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                             "n_shared_experts": 1, "first_k_dense_replace": 1}
    return config


CLASSES: dict[str, TinyKind] = {
    "janus": TinyKind("janus", _JANUS_TEMPLATE, "deepseek-ai/Janus-Pro-1B (transformers' conversion)",
                      (_BOS, _EOS, _PAD, "<image_placeholder>", "<begin_of_image>", "<end_of_image>"),
                      bos=_BOS, eos=_EOS, pad=_PAD,
                      named_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                                    "eoi_token": "<end_of_image>"},
                      processor=_janus_processor, config=_janus_config,
                      released_sizes={"size": 384, "num_image_tokens": 576}),
    "llama4": TinyKind("llama4", _LLAMA4_TEMPLATE, "meta-llama/Llama-4-Scout-17B-16E-Instruct",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad|>", "<|header_start|>",
                        "<|header_end|>", "<|eot|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>",
                        "<|tile_x_separator|>", "<|tile_y_separator|>"),
                       bos="<|begin_of_text|>", eos="<|eot|>", pad="<|finetune_right_pad|>",
                       processor=_llama4_processor, config=_llama4_config,
                       released_sizes={"size": 336, "max_patches": 16}),
    "hunyuan_vl": TinyKind("hunyuan_vl", _HY_TEMPLATE, "tencent/HunyuanOCR (structure; its template text reduced)",
                           (_HY_BOS, _HY_EOS, _HY_PAD, _hy("place holder no 3"), _hy("User"), _hy("Assistant"),
                            *_HY_IMAGE.values(), _hy("place holder no 103")),
                           bos=_HY_BOS, eos=_HY_EOS, pad=_HY_PAD, named_tokens=dict(_HY_IMAGE),
                           processor=_hunyuan_processor, config=_hunyuan_config, projector_in_vision=True,
                           released_sizes={"min_pixels": 512 * 512, "max_pixels": 2048 * 2048}),
    "qwen3_5": _qwen_kind("qwen3_5", _QWEN35_TEMPLATE.replace("{GEN}", "").replace("{END}", ""),
                          "Qwen/Qwen3.5-* (its template's logic)", _qwen35_config,
                          _QWEN35_TEMPLATE.replace("{GEN}", "{% generation %}").replace("{END}", "{% endgeneration %}")),
    "qwen3_5_moe": _qwen_kind("qwen3_5_moe", _QWEN35_TEMPLATE.replace("{GEN}", "").replace("{END}", ""),
                              "Qwen/Qwen3.5-*-A*B (its template's logic)", _qwen35_moe_config,
                              _QWEN35_TEMPLATE.replace("{GEN}", "{% generation %}")
                              .replace("{END}", "{% endgeneration %}")),
    "molmo2": TinyKind("molmo2", _MOLMO2_TEMPLATE, "allenai/Molmo2-4B", ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                       *_MOLMO2_IMAGE_TOKENS), bos="<|endoftext|>", add_bos=False,
                       named_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
                       processor=_molmo2_processor, config=_molmo2_config,
                       released_sizes={"size": 378, "max_crops": 8}),
    # Qwen3-VL's released (prefix-stable) template is the qwen2_vl family's; here its MoE class on the auto path
    "qwen3_vl_moe": _qwen_kind("qwen3_vl_moe", "{%- set ns = namespace(last_query_index=-1) %}"
                               + _QWEN35_TEMPLATE[_QWEN35_TEMPLATE.index("{%- for message in messages %}{%- set content"):]
                               .replace("loop.index0 > ns.last_query_index", "false").replace("{GEN}", "")
                               .replace("{END}", "").replace("{%- if enable_thinking is defined and enable_thinking is "
                                                             "false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                                                             "{%- else %}{{- '<think>\\n' }}{%- endif %}", ""),
                               "Qwen/Qwen3-VL-30B-A3B-Instruct (ChatML)", _qwen3vl_moe_config),
    "qwen4_exp": _qwen_kind("qwen4_exp", _QWEN35_TEMPLATE.replace("{GEN}", "").replace("{END}", ""),
                            "Qwen4-Exp (Qwen3.5's template logic)", _qwen4_exp_config,
                            _QWEN35_TEMPLATE.replace("{GEN}", "{% generation %}")
                            .replace("{END}", "{% endgeneration %}")),
    "qwen2_5_vl": TinyKind("qwen2_5_vl", QWEN2_VL_CHAT_TEMPLATE, "Qwen/Qwen2.5-VL-7B-Instruct",
                           ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                            "<|image_pad|>", "<|video_pad|>"), add_bos=False,
                           named_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
                           processor=_qwen25vl_processor, config=_qwen25vl_config, projector_in_vision=True,
                           released_sizes={"min_pixels": 4 * 28 * 28, "max_pixels": 12845056}),
    "lfm2_vl": TinyKind("lfm2_vl", _LFM2_VL_TEMPLATE, "LiquidAI/LFM2-VL-1.6B",
                        ("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>") + _LFM2_VL_TOKENS,
                        bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>", add_bos=False,
                        named_tokens={"image_token": "<image>"},
                        processor=_lfm2_vl_processor, config=_lfm2_vl_config,
                        released_sizes={"tile_size": 512, "min_image_tokens": 64, "max_image_tokens": 256,
                                        "max_tiles": 10}),
    "kimi_k25": TinyKind("kimi_k25", _KIMI_TEMPLATE, "moonshotai/Kimi-K2.5 (its turns; thinking parts left out)",
                         _KIMI_TOKENS, bos="[BOS]", eos="<|im_end|>", pad="[PAD]", add_bos=False,
                         named_tokens={"image_token": "<|media_pad|>"}, processor=_kimi_processor, config=_kimi_config,
                         released_sizes={"max_side": 512, "max_patches": 16384}),
    "minicpmv4_6": TinyKind("minicpmv4_6", _MOLMO2_TEMPLATE.replace("<|image|>", "<image>"),
                            "openbmb/MiniCPM-V-4.6 (ChatML)",
                            ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", *_MINICPM_NAMED.values()),
                            add_bos=False, named_tokens={"image_token": "<image>", **_MINICPM_NAMED},
                            processor=_minicpm_processor, config=_minicpm_config,
                            released_sizes={"scale_resolution": 448, "max_slice_nums": 9}),
    "cohere2_vision": TinyKind("cohere2_vision", _COHERE2_VISION_TEMPLATE, "CohereLabs/command-a-vision-07-2025",
                               ("<PAD>", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>",
                                "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_RESPONSE|>",
                                "<|END_RESPONSE|>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
                                "<|IMG_LINE_BREAK|>"),
                               bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>",
                               named_tokens={"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>",
                                             "eoi_token": "<|END_OF_IMG|>",
                                             "img_line_break_token": "<|IMG_LINE_BREAK|>"},
                               processor=_cohere2_vision_processor, config=_cohere2_vision_config,
                               released_sizes={"size": 512, "max_patches": 12, "patch_size": 16}),
    "step3p7": TinyKind("step3p7", _STEP3P7_TEMPLATE, "stepfun-ai/Step-3.7-Flash (ChatML)",
                        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<im_start>", "<im_end>",
                         "<patch_start>", "<patch_end>", "<patch_newline>"), add_bos=False,
                        processor=_step3p7_processor, config=_step3p7_config,
                        released_sizes={"size": 728, "crop": 504}),
    "gemma4": TinyKind("gemma4", _GEMMA4_TEMPLATE, "google/gemma-4-E4B-it",
                       ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool_response>", *_GEMMA4_NAMED.values(),
                        "<|video|>"),
                       bos="<bos>", eos="<eos>", pad="<pad>", add_bos=False, named_tokens=dict(_GEMMA4_NAMED),
                       generation_eos=("<eos>", "<turn|>", "<|tool_response>"),
                       processor=_gemma4_processor, config=_gemma4_config,
                       released_sizes={"patch_size": 16, "max_soft_tokens": 280}),
    "glm4v_moe": replace(FIRST["glm4v"], model_type="glm4v_moe", template=_GLM46V_TEMPLATE,
                         released="zai-org/GLM-4.5V (the GLM-4.5V / 4.6V template's logic)", config=_glm45v_config,
                         special_tokens=FIRST["glm4v"].special_tokens + ("<|observation|>", "<think>", "</think>"),
                         generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>")),
    "glm46v": TinyKind("glm46v", _GLM46V_TEMPLATE, "zai-org/GLM-4.6V (its template's logic)",
                       FIRST["glm4v"].special_tokens + ("<|observation|>", "<think>", "</think>"),
                       eos="<|endoftext|>", pad="<|endoftext|>",
                       generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>"), projector_in_vision=True,
                       processor=_glm46v_processor, config=_glm46v_config,
                       released_sizes={"min_pixels": 112 * 112, "max_pixels": 28 * 28 * 12288}),
}
