"""Image data (p2ptrain/images.py): scikit-learn's digits, MNIST's IDX files and folders of images, their
fixed splits, their identity, and the one-line refusals of files that are not what they claim."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from p2ptrain.config import ConfigError, DataConfig, load_config
from p2ptrain.data import corpus_digest, open_corpus
from p2ptrain.images import TEST_FRACTION, ImageSet, read_idx
from p2ptrain.models import build_model, num_params


def write_idx(path, array: np.ndarray, *, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def mnist_like(folder, n_train=40, n_test=12, size=12, gz=False, test=True):
    """A small IDX folder in MNIST's layout: each class is a bright square at its own place."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        if split == "t10k" and not test:
            continue
        labels = rng.integers(0, 4, n)
        images = rng.integers(0, 40, (n, size, size))
        for i, label in enumerate(labels):
            r, c = divmod(int(label), 2)
            images[i, r * 6 : r * 6 + 6, c * 6 : c * 6 + 6] = 250
        write_idx(folder / f"{split}-images-idx3-ubyte{suffix}", images, gz=gz)
        write_idx(folder / f"{split}-labels-idx1-ubyte{suffix}", labels, gz=gz)
    return folder


def test_the_digits_split_the_same_way_every_time_and_normalize_per_channel():
    data = open_corpus(DataConfig(source="digits"), 64, 0.1)
    assert isinstance(data, ImageSet)
    total = len(data.train_x) + len(data.val_x) + len(data.test_x)
    assert total == 1797 and len(data.test_x) == int(1797 * TEST_FRACTION)
    assert data.train_x.shape[1:] == (1, 8, 8) and data.num_classes == 10
    again = open_corpus(DataConfig(source="digits"), 64, 0.1)
    assert torch.equal(data.test_x, again.test_x) and torch.equal(data.val_y, again.val_y)
    x = data.normalize(data.train_x)
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    assert data.model_args() == {"num_classes": 10, "channels": 1, "image_size": (8, 8)}
    assert corpus_digest(DataConfig(source="digits")) == corpus_digest(DataConfig(source="digits"))


def test_the_shards_of_a_round_are_disjoint_and_cover_the_training_images():
    data = open_corpus(DataConfig(source="digits"), 64, 0.1)
    shards = [data.shard(seed=1, round=3, rank=r, world=3) for r in range(3)]
    seen = torch.cat(shards)
    assert len(seen) == len(set(seen.tolist())) == data.num_train_windows()
    x, y = next(data.batches(shards[0], 16))
    assert x.shape == (16, 1, 8, 8) and x.dtype == torch.float32 and y.shape == (16,)
    assert torch.equal(y, data.train_y[shards[0][:16]])


@pytest.mark.parametrize("gz", [False, True])
def test_an_idx_folder_reads_as_mnist_does_with_its_own_test_split(tmp_path, gz):
    folder = mnist_like(tmp_path / "mnist", gz=gz)
    data = open_corpus(DataConfig(source="idx", path=folder), 64, 0.25)
    assert len(data.test_x) == 12 and len(data.train_x) + len(data.val_x) == 40
    assert data.train_x.shape[1:] == (1, 12, 12) and data.num_classes == 4
    without_test = mnist_like(tmp_path / "no-test", test=False)
    carved = open_corpus(DataConfig(source="idx", path=without_test), 64, 0.25)
    assert len(carved.test_x) == int(40 * TEST_FRACTION)


def test_malformed_idx_files_are_refused_naming_the_file(tmp_path):
    folder = mnist_like(tmp_path / "m")
    images = folder / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(good[:-5])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte has .* bytes of data; its header says"):
        read_idx(images)
    images.write_bytes(b"\x01\x02" + good[2:])
    with pytest.raises(ValueError, match="is not an IDX file"):
        read_idx(images)
    images.write_bytes(good[:2] + b"\x0d" + good[3:])
    with pytest.raises(ValueError, match=r"IDX type 0x0d; only unsigned bytes"):
        read_idx(images)
    write_idx(images, np.zeros((39, 12, 12)))
    with pytest.raises(ValueError, match="has 39 images but .*train-labels-idx1-ubyte 40 labels"):
        open_corpus(DataConfig(source="idx", path=folder), 64, 0.25)
    (folder / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(ValueError, match="has no train-labels-idx1-ubyte"):
        open_corpus(DataConfig(source="idx", path=folder), 64, 0.25)


def test_idx_files_that_are_broken_gzip_empty_one_class_or_of_two_sizes_are_refused_naming_the_file(tmp_path):
    def refused(folder, says):
        with pytest.raises(ValueError, match=says) as e:
            open_corpus(DataConfig(source="idx", path=folder), 64, 0.25)
        assert "\n" not in str(e.value)

    folder = mnist_like(tmp_path / "gz", gz=True)
    images = folder / "train-images-idx3-ubyte.gz"
    whole = images.read_bytes()
    images.write_bytes(whole[: len(whole) // 2])  # truncated
    refused(folder, r"train-images-idx3-ubyte.gz is not a whole gzip file")
    images.write_bytes(b"plain bytes under a .gz name")
    refused(folder, r"train-images-idx3-ubyte.gz is not a whole gzip file")
    folder = mnist_like(tmp_path / "empty")
    write_idx(folder / "t10k-images-idx3-ubyte", np.zeros((0, 12, 12)))
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros((0,)))
    refused(folder, r"t10k-images-idx3-ubyte holds no images")
    folder = mnist_like(tmp_path / "sizes")
    write_idx(folder / "t10k-images-idx3-ubyte", np.zeros((12, 16, 16)))  # the training images are 12x12
    refused(folder, r"t10k-images-idx3-ubyte holds 16x16 images; the training images are 12x12")
    folder = mnist_like(tmp_path / "one", test=False)
    write_idx(folder / "train-labels-idx1-ubyte", np.zeros((40,)))
    refused(folder, r"labels name one class: a classifier needs two or more")


def test_image_folders_of_one_class_or_16_bit_images_are_refused(tmp_path):
    from PIL import Image

    for i in range(3):
        _png(tmp_path / "one" / "cat" / f"{i}.png", np.zeros((8, 8)))
    with pytest.raises(ValueError, match=r"has one class folder \(cat\): a classifier needs two or more"):
        open_corpus(DataConfig(source="images", path=tmp_path / "one"), 64, 0.1)
    for name in ("cat", "dog"):
        (tmp_path / "deep" / name).mkdir(parents=True)
        Image.fromarray(np.full((8, 8), 63000, dtype=np.uint16)).save(tmp_path / "deep" / name / "0.png")
    with pytest.raises(ValueError, match=r"0.png is a I(;16)? image; images of 8 bits a channel are read"):
        open_corpus(DataConfig(source="images", path=tmp_path / "deep"), 64, 0.1)


def _png(path, pixels: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.astype(np.uint8)).save(path)


def test_an_image_folder_reads_classes_from_subfolders_in_either_layout(tmp_path):
    rng = np.random.default_rng(1)
    for name in ("cat", "dog"):
        for i in range(10):
            _png(tmp_path / "flat" / name / f"{i}.png", rng.integers(0, 255, (6, 5)))
            split = "train" if i < 7 else "test"
            _png(tmp_path / "split" / split / name / f"{i}.png", rng.integers(0, 255, (6, 5, 3)))
    (tmp_path / "flat" / "cat" / ".hidden.png").write_bytes(b"not an image, and skipped")
    flat = open_corpus(DataConfig(source="images", path=tmp_path / "flat"), 64, 0.1)
    assert flat.classes == ["cat", "dog"] and flat.train_x.shape[1:] == (1, 6, 5)
    assert len(flat.test_x) == int(20 * TEST_FRACTION)
    split = open_corpus(DataConfig(source="images", path=tmp_path / "split"), 64, 0.25)
    # The files come sorted by class; the validation split, cut from the end, must not be one class.
    assert set(split.val_y.tolist()) == {0, 1} and len(split.val_y) == int(14 * 0.25)
    assert split.train_x.shape[1:] == (3, 6, 5) and len(split.test_x) == 6
    model = build_model("cnn-tiny", 64, **split.model_args())
    assert model(split.normalize(split.test_x)).shape == (6, 2) and num_params(model) > 0


def test_a_folder_of_mixed_sizes_or_broken_files_is_refused_naming_the_file(tmp_path):
    _png(tmp_path / "a" / "x" / "0.png", np.zeros((8, 8)))
    _png(tmp_path / "a" / "y" / "1.png", np.zeros((9, 8)))
    with pytest.raises(ValueError, match=r"1.png is 8x9; the others are 8x8"):
        open_corpus(DataConfig(source="images", path=tmp_path / "a"), 64, 0.1)
    _png(tmp_path / "b" / "y" / "1.png", np.zeros((8, 8)))
    (tmp_path / "b" / "x").mkdir(parents=True)
    (tmp_path / "b" / "x" / "0.png").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"0.png is not an image that opens"):
        open_corpus(DataConfig(source="images", path=tmp_path / "b"), 64, 0.1)
    _png(tmp_path / "c" / "loose.png", np.zeros((8, 8)))
    with pytest.raises(ValueError, match="images outside class folders"):
        open_corpus(DataConfig(source="images", path=tmp_path / "c"), 64, 0.1)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="no images"):
        open_corpus(DataConfig(source="images", path=tmp_path / "d"), 64, 0.1)


def test_the_data_identity_follows_the_files_content(tmp_path):
    folder = mnist_like(tmp_path / "m")
    cfg = DataConfig(source="idx", path=folder)
    before = corpus_digest(cfg)
    assert corpus_digest(DataConfig(source="idx", path=mnist_like(tmp_path / "copy"))) == before
    labels = folder / "t10k-labels-idx1-ubyte"
    raw = bytearray(labels.read_bytes())
    raw[-1] = (raw[-1] + 1) % 4
    labels.write_bytes(bytes(raw))
    assert corpus_digest(cfg) != before


def test_a_model_that_does_not_fit_the_data_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"model.name: gpt-micro models text; data.source 'digits' is images"
    ):
        load_config(None, {"data": {"source": "digits"}})
    with pytest.raises(ConfigError, match=r"model.name: cnn-small classifies images; data.source 'pydoc'"):
        load_config(None, {"model": {"name": "cnn-small"}})
    with pytest.raises(ConfigError, match=r"data.path is required when data.source is 'idx'"):
        load_config(None, {"data": {"source": "idx"}, "model": {"name": "cnn-small"}})


def test_a_folder_with_its_own_validation_split_keeps_it_as_validation(tmp_path):
    """train/ beside val/ (and test/ or not) is three or two splits of two classes, not four classes."""
    rng = np.random.default_rng(2)
    for name in ("cat", "dog"):
        for i in range(12):
            split = "train" if i < 8 else "val" if i < 10 else "test"
            _png(tmp_path / "both" / split / name / f"{i}.png", rng.integers(0, 255, (6, 5)))
            if split != "test":
                _png(tmp_path / "val-only" / split / name / f"{i}.png", rng.integers(0, 255, (6, 5)))
    both = open_corpus(DataConfig(source="images", path=tmp_path / "both"), 64, 0.25)
    assert both.classes == ["cat", "dog"]
    assert (len(both.train_x), len(both.val_x), len(both.test_x)) == (16, 4, 4), "data.val_fraction unused"
    # Shuffled as the training split is: evaluation reads the first data.val_batches, not one class's.
    assert sorted(both.val_y.tolist()) == [0, 0, 1, 1] and both.val_y.tolist() != [0, 0, 1, 1]
    val_only = open_corpus(DataConfig(source="images", path=tmp_path / "val-only"), 64, 0.25)
    assert val_only.classes == ["cat", "dog"] and len(val_only.val_x) == 4
    n_test = int(16 * TEST_FRACTION)
    assert (len(val_only.train_x), len(val_only.test_x)) == (16 - n_test, n_test), "test carved from train/"
    _png(tmp_path / "both" / "val" / "bird" / "0.png", np.zeros((6, 5)))
    with pytest.raises(ValueError, match=r"val has classes the training split lacks: \['bird'\]"):
        open_corpus(DataConfig(source="images", path=tmp_path / "both"), 64, 0.25)
    (tmp_path / "both" / "validation").mkdir()
    with pytest.raises(ValueError, match=r"has val/ and validation/: keep one validation split"):
        open_corpus(DataConfig(source="images", path=tmp_path / "both"), 64, 0.25)


def test_a_class_named_train_is_a_class_where_no_test_or_validation_folder_is_beside_it(tmp_path):
    rng = np.random.default_rng(3)
    for name in ("boat", "train"):
        for i in range(5):
            _png(tmp_path / name / f"{i}.png", rng.integers(0, 255, (6, 5)))
    assert open_corpus(DataConfig(source="images", path=tmp_path), 64, 0.25).classes == ["boat", "train"]
