"""Labelled images for classification: the 8x8 digits that ship with scikit-learn, MNIST's IDX files, or a
folder of images sorted into one subfolder per class.

Images are small, so a set is read into memory once as uint8 pixels (60,000 MNIST digits: 47 MB) and
normalized a batch at a time. Its three splits are fixed by the data alone, never by the run, so that test
accuracy means the same in every run: the data's own test split where it has one (MNIST's t10k files, a
folder's ``test/``), else the last ``TEST_FRACTION`` of a fixed shuffle of the images; validation is the
data's own where it has one (a folder's ``val/``), else the end of what is left for training, in the same
shuffle (``data.val_fraction``).

An ``ImageSet`` answers the trainer as a text ``Corpus`` does (``data.py``, which opens either): the same
seeded shards of example indices per round and rank (``shards.py``), batches that cycle through a shard,
fixed validation batches.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from p2ptrain.prepare import file_sha256
from p2ptrain.shards import shard_windows

TEST_FRACTION = 0.2
"""The share of a set without its own test split that is held out for testing."""
SPLIT_SEED = 20261202
"""The fixed shuffle of the training images before the test (where carved) and validation splits are cut
from their end: part of the data's definition, the same in every run."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@dataclass
class ImageSet:
    train_x: torch.Tensor
    """(N, C, H, W) uint8 pixels."""
    train_y: torch.Tensor
    """(N,) int64 class indices."""
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: list[str]
    max_value: float
    """The brightest pixel value (16 for scikit-learn's digits, 255 otherwise)."""
    mean: torch.Tensor
    std: torch.Tensor
    """Per channel, over the training pixels scaled to [0, 1]: batches are normalized with them."""

    @classmethod
    def split(
        cls,
        train: tuple[np.ndarray, np.ndarray],
        test: tuple[np.ndarray, np.ndarray] | None,
        classes: list[str],
        val_fraction: float,
        max_value: float = 255.0,
        val: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> ImageSet:
        """Split labelled images (x: (N, C, H, W) uint8, y: (N,) ints) into train, validation and test: the
        data's own ``test`` and ``val`` splits where given, else carved from ``train``.

        Raises:
            ValueError: too few images for the splits.
        """
        # Shuffled first, by a fixed seed: a folder's files come sorted by class, and a split cut from the
        # end of them would hold one class only (a validation split of its own too: evaluation reads its
        # first data.val_batches).
        x, y = _shuffled(train)
        if test is None:
            n_test = max(1, int(len(x) * TEST_FRACTION))
            test, (x, y) = (x[-n_test:], y[-n_test:]), (x[:-n_test], y[:-n_test])
        if val is not None:  # the end of x is validation
            val_x, val_y = _shuffled(val)
            x, y = np.concatenate([x, val_x]), np.concatenate([y, val_y])
        n_val = max(1, int(len(x) * val_fraction)) if val is None else len(val[0])
        if len(x) - n_val < 2:
            if val is not None:
                raise ValueError(f"{len(x) - n_val} training images are too few: two at least")
            raise ValueError(f"{len(x)} training images are too few for data.val_fraction {val_fraction}")
        scaled = torch.from_numpy(x[:-n_val]).float() / max_value
        mean = scaled.mean(dim=(0, 2, 3))
        std = scaled.std(dim=(0, 2, 3)).clamp_min(1e-3)
        t = torch.from_numpy
        return cls(
            train_x=t(np.ascontiguousarray(x[:-n_val])),
            train_y=t(y[:-n_val].astype(np.int64)),
            val_x=t(np.ascontiguousarray(x[-n_val:])),
            val_y=t(y[-n_val:].astype(np.int64)),
            test_x=t(np.ascontiguousarray(test[0])),
            test_y=t(test[1].astype(np.int64)),
            classes=classes,
            max_value=max_value,
            mean=mean,
            std=std,
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def model_args(self) -> dict:
        """What the classifier's shape follows from the data (``models.build_model``)."""
        _, channels, height, width = self.train_x.shape
        return {"num_classes": self.num_classes, "channels": channels, "image_size": (height, width)}

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch of the first images (for the device benchmark)."""
        return next(self.batches(torch.arange(min(batch_size, len(self.train_x))), batch_size))

    def num_train_windows(self) -> int:
        """Training examples (the trainer's unit of a shard, like a text corpus's windows)."""
        return len(self.train_x)

    def shard(self, *, seed: int, round: int, rank: int, world: int) -> torch.Tensor:
        """Indices of this peer's training images in one round (``shards.shard_windows``)."""
        return shard_windows(len(self.train_x), seed=seed, round=round, rank=rank, world=world)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 pixels -> float32 inputs, zero mean and unit variance per channel over the training set."""
        return (x.float() / self.max_value - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)

    def batches(self, starts: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (images, labels) batches over the given example indices, cycling if the shard runs out."""
        i = 0
        while True:
            idx = starts[torch.arange(i, i + batch_size) % len(starts)]
            i += batch_size
            yield self.normalize(self.train_x[idx]), self.train_y[idx]

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``batch_size * max_batches`` validation images, in order: the same on every peer."""
        n = min(len(self.val_x), batch_size * max_batches)
        for i in range(0, n, batch_size):
            j = min(i + batch_size, n)
            yield self.normalize(self.val_x[i:j]), self.val_y[i:j]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every test image, in order."""
        for i in range(0, len(self.test_x), batch_size):
            yield self.normalize(self.test_x[i : i + batch_size]), self.test_y[i : i + batch_size]


def _shuffled(split: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    x, y = split
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    return x[order], y[order]


def open_images(source: str, path: Path | None, val_fraction: float) -> ImageSet:
    """The image set of ``data.source`` (digits, idx or images) and ``data.path``.

    Raises:
        ValueError: one line naming the file or the value that is wrong.
    """
    if source == "digits":
        (x, y), classes = _digits()
        return ImageSet.split((x, y), None, classes, val_fraction, max_value=16.0)
    assert path is not None  # enforced by DataConfig
    if source == "idx":
        train, test, classes = read_idx_folder(Path(path))
        return ImageSet.split(train, test, classes, val_fraction)
    splits, classes = read_image_folder(Path(path))
    return ImageSet.split(splits["train"], splits.get("test"), classes, val_fraction, val=splits.get("val"))


def images_digest(source: str, path: Path | None) -> str:
    """The image set's identity: a sha256 of its files (names and bytes, in sorted order), or of
    scikit-learn's digits. Peers agree on their data only if this agrees."""
    if source == "digits":
        (x, y), _ = _digits()
        return hashlib.sha256(b"digits" + x.tobytes() + y.astype(np.int64).tobytes()).hexdigest()
    assert path is not None  # enforced by DataConfig
    root = Path(path)
    files = _idx_files(root) if source == "idx" else [p for _, p in _folder_files(root)]
    digest = hashlib.sha256(source.encode())
    for file in files:
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(file_sha256(file)))
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[tuple[np.ndarray, np.ndarray], list[str]]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError(
            "data.source 'digits' reads the digits that ship with scikit-learn: pip install 'p2ptrain[digits]'"
        ) from None
    digits = load_digits()  # 1797 images, 8x8, pixel values 0..16; bundled with the package, no download
    x = digits.images.astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    return (x, digits.target.astype(np.int64)), [str(c) for c in range(10)]


# ------------------------------------------------------------------------------ MNIST's IDX files


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format, gzipped or not) as an array of its unsigned bytes.

    Raises:
        ValueError: not an IDX file of unsigned bytes, or shorter than its header says.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"data.path: {path} cannot be read ({e.strerror or e})") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, or corrupt
            raise ValueError(
                f"data.path: {path} is not a whole gzip file ({e or type(e).__name__})"
            ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"data.path: {path} is not an IDX file (it does not start with two zero bytes)")
    if raw[2] != 0x08:
        raise ValueError(
            f"data.path: {path} holds IDX type 0x{raw[2]:02x}; only unsigned bytes (0x08) are read"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise ValueError(f"data.path: {path} has a truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(shape))
    if len(raw) - header != size:
        raise ValueError(f"data.path: {path} has {len(raw) - header} bytes of data; its header says {shape}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()  # writable, for torch


def _idx_path(root: Path, name: str) -> Path | None:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _idx_files(root: Path) -> list[Path]:
    found = [_idx_path(root, name) for pair in IDX_FILES.values() for name in pair]
    return [p for p in found if p is not None]


def read_idx_folder(
    root: Path,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None, list]:
    """MNIST's layout: train-images-idx3-ubyte and train-labels-idx1-ubyte (and t10k-* for the test split),
    gzipped or not.

    Raises:
        ValueError: a file is missing, malformed, or its images and labels do not pair up.
    """
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, (images_name, labels_name) in IDX_FILES.items():
        images_path, labels_path = _idx_path(root, images_name), _idx_path(root, labels_name)
        if images_path is None or labels_path is None:
            if split == "train" or (images_path is None) != (labels_path is None):
                missing = images_name if images_path is None else labels_name
                raise ValueError(f"data.path: {root} has no {missing} (MNIST's IDX layout)")
            continue
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(
                f"data.path: {images_path} must be images (N, H, W) and {labels_path} labels (N,)"
            )
        if len(images) != len(labels):
            raise ValueError(
                f"data.path: {images_path} has {len(images)} images but {labels_path} {len(labels)} labels"
            )
        if not len(images):
            raise ValueError(f"data.path: {images_path} holds no images")
        if split == "test" and images.shape[1:] != splits["train"][0].shape[2:]:
            h, w = splits["train"][0].shape[2:]
            raise ValueError(
                f"data.path: {images_path} holds {images.shape[1]}x{images.shape[2]} images; the training "
                f"images are {h}x{w}"
            )
        splits[split] = images[:, None], labels.astype(np.int64)
    num_classes = int(max(int(y.max()) for _, y in splits.values())) + 1
    if num_classes < 2:
        raise ValueError(f"data.path: {root}'s labels name one class: a classifier needs two or more")
    return splits["train"], splits.get("test"), [str(c) for c in range(num_classes)]


# ------------------------------------------------------------------------------ a folder of images


def _folder_files(root: Path) -> list[tuple[str, Path]]:
    """(split-relative class name, file) of every image under root, sorted; hidden files skipped."""
    return sorted(
        (str(p.parent.relative_to(root)), p)
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


VAL_FOLDERS = ("val", "valid", "validation")
"""The names a folder's own validation split goes by (beside ``train/``)."""


def image_folder_splits(root: Path) -> dict[str, Path]:
    """The folder of each split a folder of images has: ``root/train/`` with ``root/test/``, a validation
    folder (one of :data:`VAL_FOLDERS`) or both (a missing one carved from ``train/``); else ``root`` itself
    as ``train`` (the others carved from it).

    Raises:
        ValueError: two validation folders.
    """
    vals = [root / name for name in VAL_FOLDERS if (root / name).is_dir()]
    if not (root / "train").is_dir() or not ((root / "test").is_dir() or vals):
        return {"train": root}  # a class may be named train (trains, as against boats)
    sets = {"train": root / "train"}
    if (root / "test").is_dir():
        sets["test"] = root / "test"
    if len(vals) > 1:
        raise ValueError(
            f"data.path: {root} has {' and '.join(v.name + '/' for v in vals)}: keep one validation split"
        )
    if vals:
        sets["val"] = vals[0]
    return sets


def read_image_folder(root: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    """The labelled images of each of :func:`image_folder_splits` (``root/CLASS/*.png``, or
    ``root/train/CLASS/*`` with ``root/test/CLASS/*`` and ``root/val/CLASS/*`` where they are), and the class
    names. All images must have one size; they are read as greyscale when all are, else as RGB.

    Raises:
        ValueError: no images, an image that does not open or has another size, or a test or validation
            class that the training split lacks.
    """
    from PIL import Image, UnidentifiedImageError

    sets = image_folder_splits(root)
    files = {split: _folder_files(folder) for split, folder in sets.items()}
    for split, found in files.items():
        if not found:
            raise ValueError(
                f"data.path: no images ({', '.join(IMAGE_SUFFIXES)}) in class folders of {sets[split]}"
            )
        if any(name == "." for name, _ in found):
            raise ValueError(
                f"data.path: {sets[split]} has images outside class folders: put each class in a folder of its own"
            )
    classes = sorted({name for name, _ in files["train"]})
    if len(classes) < 2:
        raise ValueError(
            f"data.path: {sets['train']} has one class folder ({classes[0]}): a classifier needs two or more"
        )
    for split in sets.keys() - {"train"}:
        unknown = sorted({name for name, _ in files[split]} - set(classes))
        if unknown:
            raise ValueError(f"data.path: {sets[split]} has classes the training split lacks: {unknown}")
    opened: dict[str, list[tuple[int, Image.Image]]] = {}
    for split, found in files.items():
        opened[split] = []
        for name, path in found:
            try:
                # Closed at once: GIFs kept theirs open past the open-file limit.
                with Image.open(path) as file:
                    image: Image.Image = file.copy()
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
                raise ValueError(f"data.path: {path} is not an image that opens ({e})") from None
            if image.mode not in _EIGHT_BIT_MODES:
                raise ValueError(
                    f"data.path: {path} is a {image.mode} image; images of 8 bits a channel are read (convert it)"
                )
            opened[split].append((classes.index(name), image))
    grey = all(im.mode in ("L", "1", "P") and _is_grey(im) for ims in opened.values() for _, im in ims)
    mode = "L" if grey else "RGB"
    size = opened["train"][0][1].size
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, labelled in opened.items():
        pixels = []
        for (_, path), (_, image) in zip(files[split], labelled):
            if image.size != size:
                raise ValueError(
                    f"data.path: {path} is {image.size[0]}x{image.size[1]}; the others are {size[0]}x{size[1]}"
                )
            a = np.asarray(image.convert(mode), dtype=np.uint8)
            pixels.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
        arrays[split] = np.stack(pixels), np.array([label for label, _ in labelled], dtype=np.int64)
    return arrays, classes


_EIGHT_BIT_MODES = ("1", "L", "P", "LA", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
"""Pillow's modes of at most 8 bits a channel: a 16-bit or float image (I;16, I, F) would be clipped to
black and white by the conversion to RGB."""


def _is_grey(image) -> bool:
    """A palette image counts as grey when every colour of its palette is."""
    if image.mode != "P":
        return True
    rgb = np.asarray(image.convert("RGB"))
    return bool((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())
