"""Configuration of InternLM-XComposer2: the InternLM2 text model with Partial LoRA, the CLIP
vision tower and the image token (the defaults are the official 7B models').
"""

# No `from __future__ import annotations`: transformers reads `config: <ConfigClass>` annotations at run time.


from transformers import CLIPVisionConfig
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec


__all__ = [
    "InternLMXComposer2TextConfig",
    "InternLMXComposer2Config",
    "INTERNLM2_ROPE",
    "CLIP_VIT_L_14",
]


#: InternLM2-7B rotary settings: theta 1e6 and dynamic NTK with factor 1.0, which only
#: changes the base once a sequence grows past ``max_position_embeddings`` (32768).
INTERNLM2_ROPE = {"rope_type": "dynamic", "factor": 1.0, "rope_theta": 1_000_000.0}

# CLIP ViT-L/14 as the official vision tower; image_size is the XC2-VL input (490 px).
CLIP_VIT_L_14 = {
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
            self.rope_parameters = dict(INTERNLM2_ROPE)
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
        "vision_config": SubConfigSpec(config_class=CLIPVisionConfig, init_kwargs=CLIP_VIT_L_14),
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
