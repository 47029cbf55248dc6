"""Architectures of the released checkpoints the shipped configs name, for ``mmtune plan`` offline.

``mmtune plan`` sizes a run from the checkpoint's ``config.json`` without downloading it;
these are the architecture fields of the ``config.json`` files of
``Qwen/Qwen2.5-VL-7B-Instruct`` and ``Qwen/Qwen3-VL-8B-Instruct`` on the Hugging Face hub
(the values the published model cards and configs state; the hub cannot be reached from
the test environment, so they were not compared with the files byte for byte). Only fields
that size or shape the model are kept; a checkpoint directory with its own ``config.json``
always wins over them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KNOWN_ARCHITECTURES"]

_TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    # 28-layer Qwen2.5-7B decoder (GQA 28/4 heads) + 32-block window-attention ViT (1280 wide)
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "model_type": "qwen2_5_vl",
        **_TOKEN_IDS,
        "vision_token_id": 151654,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": 152064,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
        },
    },
    # 36-layer Qwen3-8B decoder (GQA 32/8 heads, head_dim 128) + 27-block ViT (1152 wide) with
    # DeepStack taps at blocks 8, 16 and 24
    "Qwen/Qwen3-VL-8B-Instruct": {
        "model_type": "qwen3_vl",
        **_TOKEN_IDS,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-06,
            "rope_theta": 5000000,
            "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            "vocab_size": 151936,
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 27,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "in_channels": 3,
            "out_hidden_size": 4096,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
}
