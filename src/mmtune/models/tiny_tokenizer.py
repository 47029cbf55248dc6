"""Moved to :mod:`mmtune.testing.tokenizers` (the one tiny tokenizer builder); its names are
looked up there on first use, so the registry's import of this module loads nothing."""


def __getattr__(name: str):
    from mmtune.testing import tokenizers

    return getattr(tokenizers, name)
