"""Fixtures for text/: the bundled SmolLM2 tokenizer (skipped if absent) and a tiny vocab."""

import pytest
from text_helpers import tiny_tokenizer


@pytest.fixture(scope="session")
def smollm_reader(bundled_model_path):
    from gguf import GGUFReader

    return GGUFReader(bundled_model_path)


@pytest.fixture(scope="session")
def smollm(smollm_reader):
    from cfr_atlas.text import Tokenizer

    return Tokenizer.from_gguf(smollm_reader)


@pytest.fixture
def tiny():
    return tiny_tokenizer()
