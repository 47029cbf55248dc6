"""The nine classes tested first (InternVL ... SmolVLM) as one :class:`~mmtune.testing.kind.TinyKind`
entry each: template, special tokens, processor builder (tiny image sizes, or the released
checkpoint's), config builder. The chat templates are written after the structure of the released
checkpoints' templates (named in each entry's ``released``), reduced to images and text: the role
headers, turn ends, image placeholders and generation prompts of the released ones, no tool calls,
no video. :data:`mmtune.testing.checkpoints.KINDS` holds these with :mod:`mmtune.testing.classes`.
"""

from __future__ import annotations

from typing import Any

from mmtune.testing.kind import TinyKind

__all__ = ["FIRST"]

_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]

# OpenGVLab/InternVL3-1B-hf: ChatML, each image item as "<IMG_CONTEXT>\n"
_INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# llava-hf/llava-onevision-qwen2-*-ov-hf: ChatML; a message's images first, then each text item after "\n"
_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# google/gemma-3-*-it: BOS, the system text folded into the first user turn, role "model", text trimmed
_GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# HuggingFaceM4/Idefics3-8B-Llama3: "<|begin_of_text|>", "User:" / "Assistant:" headers, "<end_of_utterance>\n"
_IDEFICS3_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# HuggingFaceTB/SmolVLM-256M-Instruct: Idefics3's structure after "<|im_start|>"
_SMOLVLM_TEMPLATE = "<|im_start|>" + _IDEFICS3_TEMPLATE[len("<|begin_of_text|>"):]
# mistralai/Mistral-Small-3.1-24B-Instruct-2503: BOS, [SYSTEM_PROMPT], [INST] ... [/INST] answer</s>
_MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}"
    "{% for item in message['content'] %}{{ item['text'] }}{% endfor %}{{ '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' }}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '[IMG]' }}{% else %}{{ item['text'] }}{% endif %}{% endfor %}{{ '[/INST]' }}"
    "{% else %}{% for item in message['content'] %}{{ item['text'] }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
# llava-hf/llava-v1.6-vicuna-7b-hf: "USER: " / "ASSISTANT: " headers, a message's images first (each
# "<image>\n"), each text item followed by " "; no stop token in or after an answer
_LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# CohereLabs/aya-vision-8b: BOS, "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>" headers, answers between
# "<|START_RESPONSE|>" and "<|END_RESPONSE|>", each turn ended by "<|END_OF_TURN_TOKEN|>"
_AYA_VISION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|START_OF_TURN_TOKEN|>' }}"
    "{% if message['role'] == 'system' %}{{ '<|SYSTEM_TOKEN|>' }}{% elif message['role'] == 'user' %}"
    "{{ '<|USER_TOKEN|>' }}{% else %}{{ '<|CHATBOT_TOKEN|><|START_RESPONSE|>' }}{% endif %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ '<|END_RESPONSE|>' }}{% endif %}{{ '<|END_OF_TURN_TOKEN|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>' }}"
    "{% endif %}"
)
# zai-org/GLM-4.1V-9B-Thinking: "[gMASK]<sop>", "<|role|>\n" headers, images in begin/end markers
_GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for msg in messages %}{{ '<|' + msg['role'] + '|>\n' }}"
    "{% if msg['content'] is string %}{{ msg['content'] }}{% else %}{% for item in msg['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)




# -- processors: ``(tokenizer, template, released image settings or None) -> processor`` ---------------
def _internvl_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import GotOcr2ImageProcessor, InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    values = released or {"size": 56, "max_patches": 4, "image_seq_length": 4}
    size = values["size"]
    image = GotOcr2ImageProcessor(size={"height": size, "width": size}, crop_to_patches=True, min_patches=1,
                                  max_patches=values["max_patches"])
    return InternVLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=InternVLVideoProcessor(),
                             image_seq_length=values["image_seq_length"], chat_template=template)  # fmt: skip


def _onevision_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    values = released or {"size": 28, "num_image_tokens": 4}
    size = values["size"]
    # the released grid: 1-6 tiles a side; the tiny one: the few grids a 2-layer test needs
    pinpoints = [[size * h, size * w] for h in range(1, 7) for w in range(1, 7)] if released else _PINPOINTS
    image = LlavaOnevisionImageProcessor(size={"height": size, "width": size}, image_grid_pinpoints=pinpoints)
    return LlavaOnevisionProcessor(image_processor=image, tokenizer=tokenizer,
                                   video_processor=LlavaOnevisionVideoProcessor(),
                                   num_image_tokens=values["num_image_tokens"],
                                   vision_feature_select_strategy="full", chat_template=template)  # fmt: skip


def _gemma3_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    values = released or {"size": 28, "image_seq_length": 4}
    size = values["size"]
    return Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": size, "width": size}),
                           tokenizer=tokenizer, image_seq_length=values["image_seq_length"],
                           chat_template=template)  # fmt: skip


_IDEFICS_TINY = {"longest_edge": 112, "tile": 56, "image_seq_len": 4}


def _idefics3_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    values = released or _IDEFICS_TINY
    image = Idefics3ImageProcessor(size={"longest_edge": values["longest_edge"]},
                                   max_image_size={"longest_edge": values["tile"]}, do_image_splitting=True)
    return Idefics3Processor(image_processor=image, tokenizer=tokenizer, image_seq_len=values["image_seq_len"],
                             chat_template=template)  # fmt: skip


def _smolvlm_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    values = released or _IDEFICS_TINY
    image = SmolVLMImageProcessor(size={"longest_edge": values["longest_edge"]},
                                  max_image_size={"longest_edge": values["tile"]}, do_image_splitting=True)
    return SmolVLMProcessor(image_processor=image, tokenizer=tokenizer, video_processor=SmolVLMVideoProcessor(),
                            image_seq_len=values["image_seq_len"], chat_template=template)  # fmt: skip


def _mistral3_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import PixtralImageProcessor, PixtralProcessor

    values = released or {"longest_edge": 84}
    image = PixtralImageProcessor(size={"longest_edge": values["longest_edge"]}, patch_size=14)
    return PixtralProcessor(image_processor=image, tokenizer=tokenizer, patch_size=14, spatial_merge_size=2,
                            chat_template=template)  # fmt: skip


def _aya_vision_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessor

    values = released or {"size": 56, "max_patches": 4, "patch_size": 14, "downsample_factor": 2}
    size = values["size"]
    image = GotOcr2ImageProcessor(size={"height": size, "width": size}, crop_to_patches=True, min_patches=1,
                                  max_patches=values["max_patches"])
    return AyaVisionProcessor(image_processor=image, tokenizer=tokenizer, patch_size=values["patch_size"],
                              img_size=size, downsample_factor=values["downsample_factor"],
                              chat_template=template)  # fmt: skip


def _llava_next_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    values = released or {"size": 28, "pinpoints": _PINPOINTS}
    size = values["size"]
    image = LlavaNextImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                    image_grid_pinpoints=values["pinpoints"])
    # num_additional_image_tokens=1: CLIP's CLS token, as the released processors say
    return LlavaNextProcessor(image_processor=image, tokenizer=tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=template)  # fmt: skip


def glm_vision_processor(classes: tuple[Any, Any, Any], tokenizer: Any, template: str,
                         released: dict[str, Any] | None) -> Any:
    """A GLM-V processor from its ``(image processor, processor, video processor)`` classes: 14 px
    patches merged 2 x 2, at the tiny pixel bounds (4 to 16 image tokens) or the released ones."""
    image_class, processor_class, video_class = classes
    values = released or {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}
    image = image_class(size={"shortest_edge": values["min_pixels"], "longest_edge": values["max_pixels"]},
                        patch_size=14, temporal_patch_size=2, merge_size=2)
    return processor_class(image_processor=image, tokenizer=tokenizer, video_processor=video_class(),
                           chat_template=template)  # fmt: skip


def _glm4v_processor(tokenizer: Any, template: str, released: dict[str, Any] | None) -> Any:
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    classes = (Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor)
    return glm_vision_processor(classes, tokenizer, template, released)


# -- configs: ``(tokenizer, text config defaults) -> the keyword arguments of the class's config`` --------
def _internvl_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"vision_config": {**_VISION, "image_size": [56, 56], "patch_size": [14, 14]},
            "text_config": {**text, "model_type": "qwen2"}, "image_token_id": tokenizer.convert_tokens_to_ids(
                "<IMG_CONTEXT>"), "downsample_ratio": 0.5}  # fmt: skip


def _onevision_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    return {"vision_config": {**_VISION, "model_type": "siglip_vision_model", "image_size": 28, "patch_size": 14},
            "text_config": {**text, "model_type": "qwen2"}, "image_token_id": ids("<image>"),
            "video_token_id": ids("<video>"), "image_grid_pinpoints": _PINPOINTS, "vision_feature_layer": -1,
            "vision_feature_select_strategy": "full"}  # fmt: skip


def _gemma3_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    return {"vision_config": {**_VISION, "model_type": "siglip_vision_model", "image_size": 28, "patch_size": 14},
            "text_config": {**text, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 16},
            "mm_tokens_per_image": 4, "image_token_index": ids("<image_soft_token>"),
            "boi_token_index": ids("<start_of_image>"), "eoi_token_index": ids("<end_of_image>")}  # fmt: skip


def _idefics3_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    """Idefics3's and SmolVLM's (one structure)."""
    return {"vision_config": {**_VISION, "image_size": 56, "patch_size": 14},
            "text_config": {**text, "model_type": "llama"},
            "image_token_id": tokenizer.convert_tokens_to_ids("<image>"), "scale_factor": 2}  # fmt: skip


def _mistral3_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"vision_config": {**_VISION, "model_type": "pixtral", "image_size": 84, "patch_size": 14, "head_dim": 16},
            # no sliding window, as the released text config (MistralConfig's default is 4096)
            "text_config": {**text, "model_type": "mistral", "head_dim": 16, "sliding_window": None},
            "image_token_index": tokenizer.convert_tokens_to_ids("[IMG]"),
            "spatial_merge_size": 2, "vision_feature_layer": -1}  # fmt: skip


def _aya_vision_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"vision_config": {**_VISION, "model_type": "siglip_vision_model", "image_size": 56, "patch_size": 14},
            # one sliding-window layer and one full one, as the released 3:1 pattern mixes them
            "text_config": {**text, "model_type": "cohere2", "head_dim": 16, "sliding_window": 16,
                            "layer_types": ["sliding_attention", "full_attention"]},
            "image_token_index": tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"), "downsample_factor": 2,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}  # fmt: skip


def _llava_next_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    return {"vision_config": {**_VISION, "model_type": "clip_vision_model", "image_size": 28, "patch_size": 14,
                              "projection_dim": 32},
            "text_config": {**text, "model_type": "llama"}, "image_token_index": tokenizer.convert_tokens_to_ids(
                "<image>"), "image_grid_pinpoints": _PINPOINTS, "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default", "image_seq_length": 4}  # fmt: skip


def _glm4v_config(tokenizer: Any, text: dict[str, Any]) -> dict[str, Any]:
    ids = tokenizer.convert_tokens_to_ids
    return {"vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "out_hidden_size": 64, "image_size": 56},
            "text_config": {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3]}, "head_dim": 16},
            "image_token_id": ids("<|image|>"), "video_token_id": ids("<|video|>"),
            "image_start_token_id": ids("<|begin_of_image|>"), "image_end_token_id": ids("<|end_of_image|>"),
            "video_start_token_id": ids("<|begin_of_video|>"), "video_end_token_id": ids("<|end_of_video|>")}


_IM = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_ROWS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
_IDEFICS_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>") + _ROWS

FIRST: dict[str, TinyKind] = {
    "internvl": TinyKind("internvl", _INTERNVL_TEMPLATE, "OpenGVLab/InternVL3-1B-hf",
                         _IM + ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
                         named_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                                       "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
                         processor=_internvl_processor, config=_internvl_config,
                         released_sizes={"size": 448, "max_patches": 12, "image_seq_length": 256}),
    "llava_onevision": TinyKind("llava_onevision", _ONEVISION_TEMPLATE, "llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
                                _IM + ("<image>", "<video>"), processor=_onevision_processor,
                                config=_onevision_config, released_sizes={"size": 384, "num_image_tokens": 729}),
    "gemma3": TinyKind("gemma3", _GEMMA3_TEMPLATE, "google/gemma-3-4b-it",
                       ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                        "<end_of_image>", "<image_soft_token>"),
                       bos="<bos>", eos="<eos>", pad="<pad>", generation_eos=("<eos>", "<end_of_turn>"),
                       named_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                     "image_token": "<image_soft_token>"},
                       processor=_gemma3_processor, config=_gemma3_config,
                       released_sizes={"size": 896, "image_seq_length": 256}),
    "idefics3": TinyKind("idefics3", _IDEFICS3_TEMPLATE, "HuggingFaceM4/Idefics3-8B-Llama3",
                         ("<|begin_of_text|>", "<|end_of_text|>") + _IDEFICS_TOKENS,
                         bos="<|begin_of_text|>", eos="<end_of_utterance>", pad="<|end_of_text|>",
                         processor=_idefics3_processor, config=_idefics3_config,
                         released_sizes={"longest_edge": 1456, "tile": 364, "image_seq_len": 169}),
    "mistral3": TinyKind("mistral3", _MISTRAL3_TEMPLATE, "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
                         ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                          "[IMG_BREAK]", "[IMG_END]"),
                         bos="<s>", eos="</s>", pad="<unk>", processor=_mistral3_processor, config=_mistral3_config,
                         released_sizes={"longest_edge": 1540}),
    "glm4v": TinyKind("glm4v", _GLM4V_TEMPLATE, "zai-org/GLM-4.1V-9B-Thinking",
                      ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                       "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                       "<|video|>"),
                      eos="<|endoftext|>", pad="<|endoftext|>", generation_eos=("<|endoftext|>", "<|user|>"),
                      projector_in_vision=True, processor=_glm4v_processor, config=_glm4v_config,
                      released_sizes={"min_pixels": 112 * 112, "max_pixels": 28 * 28 * 4096}),
    "llava_next": TinyKind("llava_next", _LLAVA_NEXT_TEMPLATE, "llava-hf/llava-v1.6-vicuna-7b-hf",
                           ("<unk>", "<s>", "</s>", "<image>"), bos="<s>", eos="</s>", pad="<unk>",
                           processor=_llava_next_processor, config=_llava_next_config,
                           released_sizes={"size": 336, "pinpoints": [[336, 672], [672, 336], [672, 672],
                                                                      [1008, 336], [336, 1008]]}),
    "aya_vision": TinyKind("aya_vision", _AYA_VISION_TEMPLATE, "CohereLabs/aya-vision-8b",
                           ("<PAD>", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>",
                            "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_RESPONSE|>",
                            "<|END_RESPONSE|>", "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
                            "<|IMG_LINE_BREAK|>"),
                           bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>",
                           processor=_aya_vision_processor, config=_aya_vision_config,
                           released_sizes={"size": 364, "max_patches": 12, "patch_size": 14, "downsample_factor": 2}),
    "smolvlm": TinyKind("smolvlm", _SMOLVLM_TEMPLATE, "HuggingFaceTB/SmolVLM-256M-Instruct",
                        ("<|im_start|>", "<|im_end|>") + _IDEFICS_TOKENS,
                        bos="<|im_start|>", eos="<end_of_utterance>", pad="<|im_end|>",
                        processor=_smolvlm_processor, config=_idefics3_config,
                        released_sizes={"longest_edge": 2048, "tile": 512, "image_seq_len": 64}),
}
