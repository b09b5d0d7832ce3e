"""Data for the lessons, all available offline.

- ``digits``: scikit-learn's handwritten digits (1,797 real 8x8 images that ship with the library),
  as flat vectors for MLPs or as 1x32x32 images for CNNs, with one fixed train/test split.
  Lessons 01-05 train on it.
- ``synthetic_images``: ImageNet-shaped random batches made on the device, for speed and memory
  measurements where the data pipeline must not be what is measured (lessons 04-05).
- ``image_folder_loader``: a torchvision ``ImageFolder`` loader for learners' own images.

Every loader here has ``set_epoch(epoch)`` and shuffles (and seeds its workers) from
``(seed, epoch)`` alone, so a run resumed from a checkpoint sees exactly the batches an
uninterrupted run would (``Trainer.fit`` calls ``set_epoch``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from amp_lessons.validate import check_bool, check_int, check_seed, is_int
from amp_lessons.numerics.precision import available_device

DIGITS_CLASSES = 10
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0


@lru_cache(maxsize=1)
def _digits_split() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)  # pixel values are 0..16
    y = bunch.target.astype(np.int64)
    return tuple(train_test_split(x, y, test_size=DIGITS_TEST_FRACTION,
                                  random_state=DIGITS_SPLIT_SEED, stratify=y))  # type: ignore


def digits(split: str = "train", image_size: Optional[int] = None,
           device: Union[str, torch.device, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The digits set as tensors ``(x, y)``: 1,347 train or 450 test examples (fixed split).

    ``image_size=None`` gives flat 64-vectors (for MLPs); an int gives ``N x 1 x S x S`` images,
    bilinearly upsampled from 8x8 (for CNNs). Inputs are standardised with the train set's
    mean and standard deviation.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}")
    if image_size is not None and (not is_int(image_size) or image_size < 8):
        raise ValueError(f"image_size must be None or an integer >= 8; got {image_size!r}")
    x_train, x_test, y_train, y_test = _digits_split()
    mean, std = float(x_train.mean()), float(x_train.std())
    x = torch.from_numpy(((x_train if split == "train" else x_test) - mean) / std)
    y = torch.from_numpy(y_train if split == "train" else y_test)
    if image_size is None:
        x = x.reshape(len(x), -1)
    else:
        x = x.unsqueeze(1)
        if image_size != 8:
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear",
                              align_corners=False)
    device = available_device(device) if device is not None else torch.device("cpu")
    return x.contiguous().to(device), y.to(device)


@dataclass
class TensorBatches:
    """Mini-batches of in-memory tensors, shuffled reproducibly per epoch.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a run resumed from a checkpoint
    at epoch ``e``, batch ``k`` sees exactly the batches an uninterrupted run would.
    """

    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    epoch: int = 0

    def __post_init__(self):
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y must have the same length; got {len(self.x)} and {len(self.y)}")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1; got {self.batch_size!r}")
        self.batch_size = int(self.batch_size)
        self.seed = check_seed("seed", self.seed)
        check_bool("shuffle", self.shuffle)
        check_bool("drop_last", self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle the next iteration uses."""
        self.epoch = check_int("epoch", epoch, 0)  # 1.7 was silently epoch 1

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.x)
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(n, generator=g).to(self.x.device)
        else:
            order = torch.arange(n, device=self.x.device)
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]


def digits_loaders(batch_size: int = 64, image_size: Optional[int] = None,
                   device: Union[str, torch.device, None] = None,
                   seed: int = 0) -> Tuple[TensorBatches, TensorBatches]:
    """Train and test batches of the digits set, held on ``device`` (it is under 1 MB)."""
    x_train, y_train = digits("train", image_size, device)
    x_test, y_test = digits("test", image_size, device)
    return (TensorBatches(x_train, y_train, batch_size, shuffle=True, seed=seed),
            TensorBatches(x_test, y_test, batch_size, shuffle=False))


def synthetic_images(batch_size: int, image_size: int = 224, num_classes: int = 1000,
                     device: Union[str, torch.device, None] = None,
                     channels_last: bool = False, seed: int = 0,
                     channels: int = 3) -> Tuple[torch.Tensor, torch.Tensor]:
    """One ImageNet-shaped batch ``(x, y)`` of random data made directly on ``device``:
    ``batch_size x channels x image_size x image_size`` images (``channels`` >= 1, 3 by default).

    Speed and memory do not depend on pixel values, so lessons time the model, not a loader.
    """
    for name, value, low in (("batch_size", batch_size, 1), ("image_size", image_size, 8),
                             ("num_classes", num_classes, 2), ("channels", channels, 1)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    seed = check_seed("seed", seed)
    check_bool("channels_last", channels_last)
    device = available_device(device) if device is not None else None
    g = torch.Generator(device=device).manual_seed(seed) if device is not None else \
        torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, channels, image_size, image_size, device=device, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), device=device, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


# --- learners' own images (image folders) and torchvision's classic sets ------------------------

#: torch.Generator.manual_seed takes seeds as unsigned 64-bit numbers (a negative one wraps)
_SEED_MODULUS = 2**64


def set_loader_epoch(loader, epoch: int) -> None:
    """Tell ``loader`` (or its sampler, a ``DistributedSampler``) which epoch begins, where it
    has ``set_epoch``: each epoch then shuffles differently, and a resumed run as the first did."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)


def epoch_seed(seed: int, epoch: int, offset: int = 0) -> int:
    """The generator seed of one epoch's shuffle (``TensorBatches``, ``EpochShuffleSampler``):
    ``seed * 100_003 + epoch + offset`` modulo 2**64, the range ``torch.Generator.manual_seed``
    takes (it wraps negative seeds the same way), so every valid ``seed`` (up to 2**63 - 1) and
    epoch works and the seeds that fitted before draw exactly the same orders."""
    return (int(seed) * 100_003 + int(epoch) + int(offset)) % _SEED_MODULUS


class EpochShuffleSampler(torch.utils.data.Sampler):
    """A random order of ``range(n)`` that depends only on ``(seed, epoch)``: call
    ``set_epoch(e)`` before iterating epoch ``e``. The order of an epoch can be reproduced in
    a fresh process, which is what exact resume needs (a DataLoader's own ``shuffle=True``
    draws each epoch's order from one generator, so epoch ``e`` depends on the epochs run
    before it in the same process)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = check_int("n", n, 0), check_seed("seed", seed), 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration uses."""
        self.epoch = check_int("epoch", epoch, 0)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return iter(torch.randperm(self.n, generator=g).tolist())


class EpochDataLoader(torch.utils.data.DataLoader):
    """A DataLoader with ``set_epoch(e)``: its sampler's order and the seeds of its random
    augmentations in worker processes come from ``(seed, e)`` (see ``EpochShuffleSampler``).
    With ``num_workers=0`` augmentations draw from torch's global generator, which a
    checkpoint restores."""

    def __init__(self, dataset, seed: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.seed = check_seed("seed", seed)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch: the sampler's order and the workers' base seed."""
        epoch = check_int("epoch", epoch, 0)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        if self.generator is not None:
            self.generator.manual_seed(epoch_seed(self.seed, epoch, offset=1))


class UnreadableImageError(ValueError):
    """An image file that cannot be decoded (truncated, damaged, or too many pixels for PIL's
    decompression-bomb guard); the message names the file."""


def read_image(path: str):
    """Open an image file as RGB with PIL, reading all of it now, so a truncated or damaged
    file raises ``UnreadableImageError`` naming it (PIL alone says "image file is truncated"
    without the file's name). So does an image whose header claims more pixels than PIL's guard
    allows (``PIL.Image.MAX_IMAGE_PIXELS``, twice over: a decompression bomb)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert("RGB")  # convert() decodes the whole file
    except Image.DecompressionBombError as exc:
        raise UnreadableImageError(f"cannot read image {path}: too many pixels for PIL's "
                                   f"decompression-bomb guard ({exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise UnreadableImageError(f"cannot read image {path}: {exc}") from None


def _epoch_loader(dataset, batch_size: int, shuffle: bool, num_workers: int, seed: int,
                  drop_last: bool = False) -> EpochDataLoader:
    sampler = EpochShuffleSampler(len(dataset), seed) if shuffle else None
    return EpochDataLoader(dataset, seed=seed, batch_size=batch_size, sampler=sampler,
                           drop_last=drop_last, num_workers=num_workers,
                           pin_memory=torch.cuda.is_available(),
                           generator=torch.Generator().manual_seed(
                               epoch_seed(seed, 0, offset=1)))


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TORCHVISION_SETS = ("CIFAR10", "CIFAR100", "MNIST", "FashionMNIST")


def _check_loader_args(image_size, batch_size, num_workers) -> None:
    for name, value, low in (("image_size", image_size, 8), ("batch_size", batch_size, 1),
                             ("num_workers", num_workers, 0)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def image_transforms(image_size: int, train: bool = True, channels: int = 3):
    """torchvision transforms: random resized crop + flip for training, resize + centre crop for
    evaluation; then a tensor normalised with ImageNet's statistics (``channels=1``: grayscale)."""
    from torchvision import transforms as T

    if not is_int(image_size) or image_size < 8:
        raise ValueError(f"image_size must be an integer >= 8; got {image_size!r}")
    check_bool("train", train)
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3; got {channels!r}")
    if train:
        steps = [T.RandomResizedCrop(image_size, antialias=True), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(int(round(image_size * 256 / 224)), antialias=True),
                 T.CenterCrop(image_size)]
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
    head = [T.Grayscale(1)] if channels == 1 else []  # ImageFolder already gives RGB images
    return T.Compose(head + steps + [T.ToTensor(), T.Normalize(mean, std)])


def image_folder_loader(root: Union[str, Path], image_size: int = 224, batch_size: int = 32,
                        train: bool = True, num_workers: int = 0,
                        seed: int = 0) -> "torch.utils.data.DataLoader":
    """A ``DataLoader`` over your own images laid out as ``root/<class name>/<image file>``.

    Training loaders shuffle (reproducibly from ``seed`` and the epoch given to
    ``loader.set_epoch``, so resume is exact) and augment; evaluation loaders keep order.
    Batches are ``(N x 3 x S x S float32, N int64)``; ``loader.dataset.classes`` names the
    classes. Pinned memory when CUDA is present. ValueError for a missing or empty folder; an
    image that cannot be decoded raises ``UnreadableImageError`` naming the file when its batch
    is read.
    """
    from torchvision.datasets import ImageFolder

    _check_loader_args(image_size, batch_size, num_workers)
    check_bool("train", train)
    seed = check_seed("seed", seed)
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root must be an existing folder of class subfolders; got {str(root)!r}")
    try:
        dataset = ImageFolder(str(root), transform=image_transforms(image_size, train),
                              loader=read_image)
    except (FileNotFoundError, RuntimeError) as exc:  # no class folders / no images
        raise ValueError(f"root must hold one subfolder of images per class; {exc}") from None
    return _epoch_loader(dataset, batch_size, train, num_workers, seed)


def torchvision_dataset_loader(name: str, root: Union[str, Path], image_size: int = 32,
                               batch_size: int = 64, train: bool = True, download: bool = False,
                               num_workers: int = 0, seed: int = 0) -> "torch.utils.data.DataLoader":
    """A ``DataLoader`` over one of torchvision's classic sets (CIFAR10, CIFAR100, MNIST,
    FashionMNIST) stored under ``root``; ``download=True`` fetches it first (needs internet).
    MNIST-like sets come as 1-channel images. Training loaders shuffle per ``set_epoch`` as
    ``image_folder_loader``'s do."""
    import torchvision.datasets as sets

    if name not in TORCHVISION_SETS:
        raise ValueError(f"name must be one of {', '.join(TORCHVISION_SETS)}; got {name!r}")
    _check_loader_args(image_size, batch_size, num_workers)
    if not isinstance(download, bool):
        raise ValueError(f"download must be True or False; got {download!r}")
    channels = 1 if "MNIST" in name else 3
    if channels == 1:  # small grayscale digits: no random crops, just the size
        from torchvision import transforms as T
        transform = T.Compose([T.Resize(image_size, antialias=True), T.ToTensor(),
                               T.Normalize((0.5,), (0.5,))])
    else:
        transform = image_transforms(image_size, train, channels)
    try:
        dataset = getattr(sets, name)(str(root), train=train, download=download,
                                      transform=transform)
    except RuntimeError as exc:  # "Dataset not found or corrupted"
        raise ValueError(f"root must hold {name} (or pass download=True); {exc}") from None
    return _epoch_loader(dataset, batch_size, train, num_workers, seed)


# --- text: byte-level corpora (lesson 07's GPT trains on the standard library's source) -----


EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass
class Corpus:
    """Byte-level text: ``train`` and ``val`` are uint8 tensors (every byte is a token)."""

    train: torch.Tensor
    val: torch.Tensor
    files: int
    root: str

    def describe(self) -> str:
        """One line: where the text came from and how much there is."""
        return (f"{self.files:,} .py files from {self.root}: {len(self.train) / 1e6:.2f} MB to "
                f"train on, {len(self.val) / 1e6:.2f} MB held out (every byte one of 256 tokens)")


def stdlib_files(root: Union[str, Path, None] = None) -> List[Path]:
    """The standard library's ``.py`` files under ``root`` (default: where ``os`` lives), in a
    fixed order (sorted relative paths), without site-packages or caches."""
    root = Path(root if root is not None else os.path.dirname(os.__file__))
    if not root.is_dir():
        raise ValueError(f"root must be an existing folder; got {str(root)!r}")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: Optional[int] = None, val_every: int = 20,
                  root: Union[str, Path, None] = None) -> Corpus:
    """The Python standard library's own source as training text (real, offline, on every machine).

    Files are read in ``stdlib_files`` order; every ``val_every``-th file is held out for
    validation. ``max_bytes`` caps the training text (the quick profile reads a few hundred KB).
    """
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 4096)
    check_int("val_every", val_every, 2)
    files = stdlib_files(root)
    if not files:
        raise ValueError(f"root must hold .py files; none under {root!r}")
    train, val, n_train, used = [], [], 0, 0
    for i, path in enumerate(files):
        if max_bytes is not None and n_train >= max_bytes:
            break
        try:
            text = path.read_bytes() + b"\n"
        except OSError:
            continue
        used += 1
        if i % val_every == 0:
            val.append(text)
        else:
            train.append(text)
            n_train += len(text)
    blob = b"".join(train)[:max_bytes] if max_bytes else b"".join(train)
    held = b"".join(val)
    if max_bytes:
        held = held[:max(max_bytes // 4, 4096)]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    return Corpus(as_tensor(blob), as_tensor(held), used,
                  str(root if root is not None else os.path.dirname(os.__file__)))


def batch_offsets(n: int, seq_len: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """``steps x batch_size`` random start positions in a text of ``n`` tokens (fixed by ``seed``)."""
    check_int("seq_len", seq_len, 1)
    check_int("batch_size", batch_size, 1)
    check_int("steps", steps, 1)
    check_int("seed", seed, 0)
    if n < seq_len + 2:
        raise ValueError(f"n must exceed seq_len + 1 = {seq_len + 1}; got {n}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n - seq_len - 1, (steps, batch_size), generator=g)


def text_batch(text: torch.Tensor, offsets: torch.Tensor,
               seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (``B x seq_len`` int64) starting at ``offsets``."""
    idx = offsets.to(text.device)[:, None] + torch.arange(seq_len + 1, device=text.device)
    chunk = text[idx].long()
    return chunk[:, :-1], chunk[:, 1:]

