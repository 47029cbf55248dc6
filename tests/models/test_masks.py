"""Which language models take packed rows: every layer kind of the text config must be one a packed row
is exact under; a model with any other kind (Qwen3.5's linear attention, LFM2's short convolution) gets
a hook that refuses a packed row, naming the kinds, and lets padded rows and generation through."""

import pytest
import torch
from torch import nn

from mmtune.models.masks import PackedStateLayersError, install_packed_guards, unpackable_layer_types


@pytest.mark.parametrize("model_type, layer_types, expected", [
    ("lfm2", ["conv", "full_attention", "conv"], ["conv"]),
    ("qwen3_5_text", ["linear_attention", "full_attention"], ["linear_attention"]),
    ("gemma3_text", ["sliding_attention", "full_attention"], []),
    ("llama", None, []),
])
def test_unpackable_kinds_come_from_the_config(model_type, layer_types, expected):
    from transformers import AutoConfig

    kwargs = {"num_hidden_layers": len(layer_types), "layer_types": layer_types} if layer_types else {}
    assert unpackable_layer_types(AutoConfig.for_model(model_type, **kwargs)) == expected


class _Decoder(nn.Module):
    def forward(self, hidden, **kwargs):
        return hidden


class _Model(nn.Module):
    """A stand-in with transformers' ``get_decoder``: its decoder returns what it is given."""

    def __init__(self):
        super().__init__()
        self.decoder = _Decoder()

    def get_decoder(self):
        return self.decoder


def test_a_packed_row_is_refused_and_a_padded_row_or_a_cached_step_passes():
    from transformers import AutoConfig

    model = _Model()
    install_packed_guards(model, AutoConfig.for_model("lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"]))
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    with pytest.raises(PackedStateLayersError, match=r"has layers of kinds \['conv'\].*collator.batching"):
        model.decoder(torch.zeros(1), position_ids=packed)
    model.decoder(torch.zeros(1), position_ids=torch.arange(5)[None])  # one sample
    model.decoder(torch.zeros(1), position_ids=packed, attention_mask=torch.ones(1, 5))  # padded rows
    model.decoder(torch.zeros(1), position_ids=packed, past_key_values=object())  # generation
