"""mlx_kvserve/vocabulary.py: a tokenizer's vocabulary is read once, however many requests ask."""

from __future__ import annotations

import gc

import pytest

from mlx_kvserve.vocabulary import token_ids, vocabulary_size


class CountingTokenizer:
    """A tokenizer whose get_vocab() counts its calls (a real one rebuilds the whole map)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.reads = 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.vocab)


def test_the_vocabulary_is_read_once_per_tokenizer():
    tok = CountingTokenizer({"a": 0, "b": 1, "<|end|>": 7})
    for _ in range(50):  # a request each: the harmony gate and the sampler ask
        assert token_ids(tok)["<|end|>"] == 7
        assert vocabulary_size(tok) == 8  # the highest id + 1, gaps included
    assert tok.reads == 1
    other = CountingTokenizer({"x": 0})
    assert vocabulary_size(other) == 1 and other.reads == 1  # per tokenizer, not global


def test_the_map_cannot_be_changed_by_a_caller():
    tok = CountingTokenizer({"a": 0})
    ids = token_ids(tok)
    with pytest.raises(TypeError):
        ids["b"] = 1  # type: ignore[index]
    assert dict(token_ids(tok)) == {"a": 0}


def test_a_tokenizer_without_a_vocabulary_and_a_dead_one():
    assert token_ids(object()) == {} and vocabulary_size(object()) is None
    tok = CountingTokenizer({"a": 0})
    token_ids(tok)
    del tok
    gc.collect()  # the cache holds its tokenizers weakly: a swapped-out model frees its map
    fresh = CountingTokenizer({"z": 3})
    assert vocabulary_size(fresh) == 4 and fresh.reads == 1
