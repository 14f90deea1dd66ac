import pytest
import torch

from p2ptrain.config import DataConfig
from p2ptrain.data import Corpus, load_corpus, shard_windows


def test_shards_of_a_round_are_disjoint_and_cover_everything():
    shards = [shard_windows(1000, seed=1, round=3, rank=r, world=3) for r in range(3)]
    together = torch.cat(shards)
    assert len(together) == 1000 and len(set(together.tolist())) == 1000


def test_shards_are_deterministic_and_change_with_round():
    a = shard_windows(500, seed=1, round=2, rank=1, world=4)
    assert torch.equal(a, shard_windows(500, seed=1, round=2, rank=1, world=4))
    assert not torch.equal(a, shard_windows(500, seed=1, round=3, rank=1, world=4))


def test_bad_rank_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        shard_windows(10, seed=0, round=0, rank=3, world=3)


def test_pydoc_corpus_ships_with_python_and_splits_deterministically():
    data = load_corpus(DataConfig())
    assert len(data) > 100_000
    c1 = Corpus.from_bytes(data, 32, 0.05)
    c2 = Corpus.from_bytes(data, 32, 0.05)
    assert torch.equal(c1.val.tensor(), c2.val.tensor()) and len(c1.train) + len(c1.val) == len(data)


def test_batches_are_next_byte_pairs_from_the_shard():
    corpus = Corpus.from_bytes(bytes(range(256)) * 20, 16, 0.1)
    starts = corpus.shard(seed=0, round=0, rank=0, world=2)
    x, y = next(corpus.batches(starts, 4))
    assert x.shape == (4, 16) and y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert set(((x[:, 0]) % 256).tolist()) <= set(corpus.train.rows(starts, 1)[:, 0].tolist())


def test_text_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld\n" * 500)
    data = load_corpus(DataConfig(source="text", path=path))
    assert data == path.read_bytes()
    x, _ = next(Corpus.from_bytes(data, 8, 0.1).val_batches(2, 1))
    assert x.dtype == torch.int64 and x.max() < 256


def test_the_smallest_corpus_a_split_allows_has_a_validation_window():
    # The validation split is at least context_length + 1 tokens: one window, not none (the evaluation's mean
    # over no tokens divided by zero).
    T = 64
    corpus = Corpus.from_bytes(bytes(range(256)) * 2, T, 0.05)
    assert len(corpus.val) == T + 1
    (x, y), *rest = list(corpus.val_batches(4, 2))
    assert x.shape == (1, T) and not rest and torch.equal(x[0, 1:], y[0, :-1])


def test_a_blown_up_models_perplexity_is_inf_not_an_error():
    import math

    from p2ptrain.evaluation import perplexity

    assert perplexity(2.0) == math.exp(2.0) and perplexity(710.0) == math.inf  # math.exp(710) raises
    assert math.isnan(perplexity(math.nan))


def test_tiny_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        Corpus.from_bytes(b"abc" * 10, 64, 0.1)
