"""Fixtures shared by tests in more than one folder (pytest finds them here for every test under tests/).
What tests import and are not fixtures lives in tests/support/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    """A small byte-level BPE with an end-of-text token, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(json.__file__).read_text(), Path(os.__file__).read_text()[:20000]]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=250, special_tokens=[EOT],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT).save_pretrained(d)
    return str(d)
