"""Prepared corpora (``p2ptrain data prepare``): sources, tokenizers, shards and manifest, and training windows
read from the memory map."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from p2ptrain.config import ConfigError, DataConfig, load_config
from p2ptrain.data import Corpus, Tokens, corpus_digest, open_corpus
from p2ptrain.prepare import Manifest, PrepareError, Tokenizer, expand_sources, prepare

TEXT = "The quick brown fox jumps over the lazy dog. Über naïve café, 東京.\n"


def write_corpus(folder, files=3, lines=200):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"doc{i}.txt").write_text(f"document {i}\n" + TEXT * lines)
    return folder


def test_byte_tokens_are_the_files_bytes_joined_by_newlines_in_order(tmp_path):
    src = write_corpus(tmp_path / "src")
    manifest = prepare([str(src)], tmp_path / "out", shard_tokens=5000)
    expected = b"\n".join((src / f"doc{i}.txt").read_bytes() for i in range(3)) + b"\n"
    corpus = Corpus.from_prepared(tmp_path / "out", 16, 0.1)
    got = torch.cat([corpus.train.tensor(), corpus.val.tensor()])
    assert bytes(got.to(torch.uint8).tolist()) == expected
    assert manifest.documents == 3 and manifest.num_tokens == len(expected) and manifest.dtype == "uint8"
    assert len(manifest.shards) == -(-len(expected) // 5000)  # several shard files, read as one sequence


def test_windows_across_shard_files_read_the_same_as_from_memory(tmp_path):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "one", shard_tokens=1 << 30)
    prepare([str(src)], tmp_path / "many", shard_tokens=777)
    one = Corpus.from_prepared(tmp_path / "one", 32, 0.05)
    many = Corpus.from_prepared(tmp_path / "many", 32, 0.05)
    starts = one.shard(seed=3, round=2, rank=0, world=1)
    assert torch.equal(next(one.batches(starts, 64))[0], next(many.batches(starts, 64))[0])
    assert torch.equal(one.val.tensor(), many.val.tensor())
    # The manifest's hash is of the tokens, not of how they are cut into files.
    assert Manifest.read(tmp_path / "one").sha256 == Manifest.read(tmp_path / "many").sha256


def test_a_bpe_trained_on_the_corpus_round_trips_text_and_ends_documents(tmp_path):
    src = write_corpus(tmp_path / "src")
    manifest = prepare([str(src)], tmp_path / "out", tokenizer="bpe", vocab_size=400)
    assert manifest.tokenizer == "bpe" and manifest.vocab_size <= 400 and manifest.dtype == "uint16"
    corpus = Corpus.from_prepared(tmp_path / "out", 16, 0.1)
    ids = torch.cat([corpus.train.tensor(), corpus.val.tensor()]).tolist()
    assert ids.count(manifest.end_of_text) == 3
    first = ids[: ids.index(manifest.end_of_text)]
    tok = Tokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    assert tok.decode(first) == (src / "doc0.txt").read_text()
    assert manifest.num_tokens < len((src / "doc0.txt").read_bytes()) * 3 / 2  # it compresses
    # The tokenizer file of one run prepares another corpus with the same ids.
    again = prepare([str(src)], tmp_path / "again", tokenizer=str(tmp_path / "out" / "tokenizer.json"))
    assert again.sha256 == manifest.sha256


def test_jsonl_rows_are_documents_and_a_bad_row_is_named(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(5)) + "\n\n")
    manifest = prepare([str(rows)], tmp_path / "out")
    assert manifest.documents == 5 and manifest.num_tokens == len("row 0\n") * 5
    rows.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(PrepareError, match=r"rows.jsonl:2: no string field 'text'"):
        prepare([str(rows)], tmp_path / "bad")


def test_parquet_files_and_saved_datasets_prepare_the_same_tokens_as_the_jsonl_of_their_rows(tmp_path):
    datasets = pytest.importorskip("datasets")  # dev extra: writes the files as users' tools do

    texts = [f"row {i}: {TEXT}" for i in range(3000)]  # more rows than one record batch
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    expected = prepare([str(rows)], tmp_path / "from-jsonl")
    table = datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.save_to_disk(str(tmp_path / "saved"), max_shard_size="100KB")  # several Arrow files
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(
        str(tmp_path / "dict")
    )
    for source in ("rows.parquet", "saved", "dict"):
        got = prepare([str(tmp_path / source)], tmp_path / f"from-{source}")
        assert got.sha256 == expected.sha256 and got.documents == len(texts), source
    test_split = prepare([str(tmp_path / "dict")], tmp_path / "test-split", split="test")
    assert test_split.documents == 3

    with pytest.raises(
        PrepareError, match=r"rows.parquet: no column 'body' \(it has id, text\); --text-field"
    ):
        prepare([str(tmp_path / "rows.parquet")], tmp_path / "bad", text_field="body")
    with pytest.raises(PrepareError, match=r"column 'id' holds int64, not text"):
        prepare([str(tmp_path / "saved")], tmp_path / "bad", text_field="id")
    with pytest.raises(PrepareError, match=r"a saved DatasetDict without split 'validation'"):
        prepare([str(tmp_path / "dict")], tmp_path / "bad", split="validation")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(PrepareError, match=r"broken.parquet: not a Parquet file"):
        prepare([str(tmp_path / "broken.parquet")], tmp_path / "bad")


def test_sources_are_globs_and_folders_in_order_and_bad_ones_are_refused(tmp_path):
    src = write_corpus(tmp_path / "src")
    (src / ".hidden").write_text("skipped")
    assert [s.path.name for s in expand_sources([str(src)])] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert [s.path.name for s in expand_sources([str(src / "doc[12].txt")])] == ["doc1.txt", "doc2.txt"]
    with pytest.raises(PrepareError, match="no such file"):
        expand_sources([str(tmp_path / "nope.txt")])
    with pytest.raises(PrepareError, match="matches no file"):
        expand_sources([str(tmp_path / "*.md")])
    (tmp_path / "binary.txt").write_bytes(b"ok\n\xff\xfe")
    with pytest.raises(PrepareError, match=r"binary.txt: not UTF-8 text \(byte 3\)"):
        prepare([str(tmp_path / "binary.txt")], tmp_path / "out")


def test_a_prepare_never_reads_what_it_wrote_inside_a_source_folder_and_names_a_source_it_cannot_read(
    tmp_path,
):
    src = write_corpus(tmp_path / "src")
    first = prepare([str(src)], src / "prepared")
    again = prepare([str(src)], src / "prepared")  # its manifest and tokens are in src now
    assert (again.num_tokens, again.sha256) == (first.num_tokens, first.sha256)
    again = prepare([str(src / "prepared" / "*"), str(src)], src / "prepared")  # a glob of them: none read
    assert again.sha256 == first.sha256
    with pytest.raises(PrepareError, match=r"^source x+: cannot read it \(File name too long\)"):
        expand_sources(["x" * 300])


def test_a_tokenizer_whose_ids_leave_gaps_prepares_a_corpus_that_reads_back(tmp_path):
    """Its vocabulary is its ids (the highest + 1), not their count: a manifest whose end-of-text id is past
    its vocabulary is refused when read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from p2ptrain.prepare import END_OF_TEXT

    holes = HFTokenizer(
        models.WordLevel({"some": 0, "text": 1, "[UNK]": 2, END_OF_TEXT: 7}, unk_token="[UNK]")
    )
    holes.pre_tokenizer = pre_tokenizers.Whitespace()
    holes.save(str(tmp_path / "holes.json"))
    (tmp_path / "a.txt").write_text("some text some text\n")
    manifest = prepare([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer=str(tmp_path / "holes.json"))
    assert (manifest.vocab_size, manifest.end_of_text) == (8, 7)
    assert Manifest.read(tmp_path / "out").vocab_size == 8


def test_a_long_line_is_cut_between_characters_never_inside_one(tmp_path, monkeypatch):
    import p2ptrain.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "_PIECE_BYTES", 7)  # cuts fall inside multibyte characters
    path = tmp_path / "one-line.txt"
    path.write_text("é東京x" * 50)
    prepare([str(path)], tmp_path / "out")
    corpus = Corpus.from_prepared(tmp_path / "out", 8, 0.1)
    got = bytes(torch.cat([corpus.train.tensor(), corpus.val.tensor()]).to(torch.uint8).tolist())
    assert got == path.read_bytes() + b"\n"


def test_a_prepare_that_fails_part_way_leaves_the_folders_corpus_as_it_was(tmp_path):
    out = tmp_path / "out"
    good = prepare([str(write_corpus(tmp_path / "src"))], out, shard_tokens=5000)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "lone \ud800 half"}) + "\n")
    with pytest.raises(PrepareError, match=r"rows.jsonl:2: field 'text' holds a lone surrogate \('\\ud800'"):
        prepare([str(tmp_path / "src"), str(rows)], out, shard_tokens=5000)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no staging left, nothing replaced
    assert Manifest.read(out).sha256 == good.sha256
    # One that succeeds replaces it whole: fewer shards, and no BPE tokenizer left from an earlier corpus.
    prepare([str(write_corpus(tmp_path / "src"))], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    small = prepare([str(tmp_path / "src" / "doc0.txt")], tmp_path / "bpe", shard_tokens=1 << 20)
    assert sorted(f.name for f in (tmp_path / "bpe").iterdir()) == ["manifest.json", "tokens-00000.bin"]
    assert Manifest.read(tmp_path / "bpe").sha256 == small.sha256 and small.tokenizer == "byte"


def test_sources_of_empty_documents_hold_no_text(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PrepareError, match="the sources hold no text"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "out")  # its one separator is no corpus
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_manifest_with_fields_of_the_wrong_kind_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    prepare([str(write_corpus(tmp_path / "src"))], out)
    doc = json.loads((out / "manifest.json").read_text())
    for field, value, says in [
        ("dtype", "int77", "dtype 'int77'"),
        ("dtype", "uint16", "dtype 'uint16': uint8 holds 256 ids"),
        ("vocab_size", "256", "vocab_size '256'"),
        ("shards", ["tokens-00000.bin"], "shard 'tokens-00000.bin'"),
        ("shards", None, "shards None"),
        ("shards", [{"file": "tokens-00000.bin"}], "not a file name and a token count"),
        ("shards", [{"file": "../../etc/passwd", "tokens": 1}], "not a name in the folder"),
        ("num_tokens", -1, "num_tokens -1"),
        ("end_of_text", 1_000_000, "end_of_text 1000000: not a token id below vocab_size 256"),
        ("vocab_size", 1 << 40, "not a whole number from 1 to 16777216"),
    ]:
        (out / "manifest.json").write_text(json.dumps({**doc, field: value}))
        with pytest.raises(PrepareError, match="not a p2ptrain manifest") as refused:
            Manifest.read(out)
        assert says in str(refused.value) and "\n" not in str(refused.value), (field, value)


def test_documents_of_a_tokenizer_without_an_end_of_text_token_are_joined_by_its_newline(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([TEXT * 50], trainer)
    bpe.save(str(tmp_path / "theirs.json"))
    manifest = prepare(
        [str(write_corpus(tmp_path / "src"))], tmp_path / "out", tokenizer=str(tmp_path / "theirs.json")
    )
    assert manifest.end_of_text is None
    corpus = Corpus.from_prepared(tmp_path / "out", 16, 0.1)
    ids = torch.cat([corpus.train.tensor(), corpus.val.tensor()]).tolist()
    text = "".join((tmp_path / "src" / f"doc{i}.txt").read_text() + "\n" for i in range(3))
    assert Tokenizer.from_file(tmp_path / "theirs.json").decode(ids) == text


def test_a_damaged_folder_is_refused_with_a_line_that_says_what_to_do(tmp_path):
    prepare([str(write_corpus(tmp_path / "src"))], tmp_path / "out")
    with pytest.raises(PrepareError, match="no manifest.json; prepare it"):
        Manifest.read(tmp_path / "src")
    shard = tmp_path / "out" / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(PrepareError, match="tokens-00000.bin: missing or not"):
        Manifest.read(tmp_path / "out")


def test_the_config_names_prepared_data_by_its_tokens_and_refuses_a_folder_without_them(tmp_path):
    src = write_corpus(tmp_path / "src")
    prepare([str(src)], tmp_path / "a")
    prepare([str(src)], tmp_path / "b")
    (src / "doc1.txt").write_text("other words\n" * 300)
    prepare([str(src)], tmp_path / "c")
    digests = [corpus_digest(DataConfig(source="prepared", path=tmp_path / n)) for n in "abc"]
    assert digests[0] == digests[1] != digests[2]
    cfg = load_config(None, {"data": {"source": "prepared", "path": str(tmp_path / "a")}})
    assert cfg.training_sections()["data"]["sha256"] == digests[0]
    assert open_corpus(cfg.data, 16, 0.05).vocab_size == 256
    with pytest.raises(ConfigError, match="data.*no manifest.json"):
        load_config(None, {"data": {"source": "prepared", "path": str(src)}})


def test_tokens_views_and_rows_over_pieces():
    tokens = Tokens([np.arange(0, 10, dtype=np.uint16), np.arange(10, 25, dtype=np.uint16)])
    view = tokens.view(5, 20)
    assert len(view) == 15 and view.tensor().tolist() == list(range(5, 20))
    rows = view.rows(torch.tensor([0, 3, 9]), 4)
    assert rows.dtype == torch.int64 and rows.tolist() == [[5, 6, 7, 8], [8, 9, 10, 11], [14, 15, 16, 17]]
    with pytest.raises(IndexError):
        view.rows(torch.tensor([12]), 4)
