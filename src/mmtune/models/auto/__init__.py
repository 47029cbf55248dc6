"""Any transformers image-text-to-text checkpoint, exact against its own processor.

For a checkpoint whose processor and chat template are in transformers (LLaVA-1.5,
InternVL, LLaVA-OneVision, LLaVA-NeXT, Gemma 3, Idefics3 / SmolVLM, Mistral 3, GLM-4.1V, Aya
Vision, ...), this adapter gives the tokens, image inputs and positions that
``processor(text=processor.apply_chat_template(messages), images=images)`` gives for the whole dialogue,
and labels the assistant turns as the template renders them:

- **text**: the dialogue's messages (image and text items in order, every text piece kept
  as written, empty pieces dropped) rendered by the checkpoint's chat template, growing one
  turn at a time; each turn's text is what rendering it adds. An assistant turn's header is
  what the generation prompt adds; its labelled part is everything the full turn adds after
  the longest common prefix with that (content and end-of-turn tokens). Where that part holds no
  generation stop token (GLM-4.1V's template ends an answer with the next turn's ``<|user|>``),
  the stop token the template renders right after the answer is labelled with it, and appended
  after the last answer, so the model learns to stop; where the template renders no stop token
  at all (llava-hf's LLaVA templates), start-up warns, and ``model.auto.answer_stop=eos``
  appends the tokenizer's EOS to every answer. Rendering more turns
  must never change the text of earlier ones, or :class:`TemplateNotPrefixStableError` names
  the dialogue, turn and first differing character. So that a long dialogue costs renders of
  a few turns each rather than of every prefix, a turn's text is taken from a window (the
  system message and the turns since the last multiple of four before it), where that gives
  the every-prefix result on probe dialogues (checked once per checkpoint) and the joined
  turns equal the whole dialogue's render (checked per dialogue); otherwise every prefix is
  rendered.
- **images**: each image placeholder (``processor.image_token``, or the one special token the
  template renders for an image item where that is another: QianfanOCR's ``<image>``) is replaced by the text the
  processor itself puts there (``return_text_replacement_offsets``, or, where its own ``__call__``
  gives none, read off the text it hands its tokenizer), which depends only on the
  image's size: it is computed once per size on a blank image, and the image's size is read
  from the file header (no pixel decode). The whole expanded text is tokenized once as the
  processor tokenizes it (no added special tokens when the template already starts with BOS),
  and every token goes to the turn, header / content part or image where it starts.
- **image inputs**: the processor called on one image at a time (what the pixel cache
  stores), joined for several images and samples per input as the processor joins them: at
  start-up the adapter calls the processor on two images together and one by one and finds,
  for every input, the concatenation axis or stack (with padding) that reproduces the joint
  call (:class:`~mmtune.models.base.InputJoin`); an input no join reproduces, or expansion
  text that depends on the other images, is refused then (:class:`UnsupportedProcessorError`).
- **token inputs**: the processor's text-aligned inputs (every integer output shaped as the ids:
  Gemma 3's ``token_type_ids``, ERNIE-4.5-VL's ``moe_mm_token_type_ids``), the value the processor
  gives each token id (read at start-up off its call on the template's rendering of two images, so
  the tokens the template puts around an image count), computed per batch from the ids.
- **positions**: one running position, or, for a model whose transformers class has its own
  ``get_rope_index`` (M-RoPE: GLM-4.1V, Qwen2-VL), that function on the sample and the image inputs
  its signature names (``image_grid_thw``; MiniCPM-V 4.7's ``target_sizes``).
- **the start-up check**: a probe dialogue's ids, image inputs, token inputs and positions against
  the processor's whole call (positions: the model class's ``get_rope_index`` on that call). A model
  class whose ``forward`` takes none of the processor's image inputs by name (Mistral 4's
  ``Mistral4ForCausalLM``, a text model listed as image-text-to-text) is refused.
- **packed rows** of a model with sliding-window layers keep transformers' block mask; its
  sliding-window mask is taken as the full-attention one within the window
  (:func:`_packed_window_masks`: transformers misplaces Gemma 3's bidirectional image blocks there).

An image the processor refuses (too small, extreme aspect ratio) raises
:class:`UnsupportedImageError` naming file, dialogue and turn, so data validation skips or
refuses it per ``data.validation.mode``. A checkpoint whose classes need code shipped with

The package is every stage of the one encoder (:mod:`mmtune.models.encoder`) taken from the
processor, one job each (see ``docs/architecture.md``):

- :mod:`.profile`: the checkpoint's processor and template loaded (:func:`load_processor_and_template`),
  its stop tokens, and the start-up probes of its image inputs' joins;
- :mod:`.render`: the chat template's rendering of a dialogue into turn / header / answer spans;
- :mod:`.image_text`: each image placeholder's text as the processor puts it, and the tokens;
- :mod:`.stops`: the stop token every answer is trained to end with;
- :mod:`.batch`: image inputs and token inputs of the batch;
- :mod:`.authority`: the start-up check of ids and image inputs against the processor's whole call;
- :mod:`.adapter`: :class:`AutoAdapter`, those stages in the encoder. Positions and the model hooks
  are the encoder's own, shared with every family.
"""

from mmtune.models.auto.adapter import AutoAdapter, AutoSettings
from mmtune.models.auto.errors import (
    RemoteCodeError,
    TemplateNotPrefixStableError,
    UnsupportedImageError,
    UnsupportedProcessorError,
)

__all__ = ["AutoAdapter", "AutoSettings", "RemoteCodeError", "TemplateNotPrefixStableError", "UnsupportedImageError",
           "UnsupportedProcessorError"]
