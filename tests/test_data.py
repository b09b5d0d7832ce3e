"""amp_lessons.data: digits, batches, synthetic images, image folders, torchvision sets."""
import numpy as np
import pytest
import torch

from amp_lessons import data
from amp_lessons.train.checkpoint import CheckpointError, check_optimizer_state


def test_digits_shapes_and_split():
    x, y = data.digits("train")
    xt, yt = data.digits("test", image_size=32)
    assert x.shape == (1347, 64) and y.shape == (1347,) and y.dtype == torch.int64
    assert xt.shape == (450, 1, 32, 32) and set(yt.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4  # standardised with the train statistics


@pytest.mark.parametrize("kwargs,message", [(dict(split="val"), "split must be"),
                                            (dict(image_size=4), "image_size must be None or")])
def test_digits_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.digits(**kwargs)


def test_tensor_batches_reproducible_per_epoch():
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    b = data.TensorBatches(x, y, batch_size=4, seed=1)
    first = [t[1].tolist() for t in b]
    assert len(b) == 3 and sum(len(f) for f in first) == 10
    assert [t[1].tolist() for t in b] == first
    b.set_epoch(1)
    assert [t[1].tolist() for t in b] != first
    assert len(data.TensorBatches(x, y, 4, drop_last=True)) == 2
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        data.TensorBatches(x, y, 0)
    with pytest.raises(ValueError, match="same length"):
        data.TensorBatches(x, y[:3], 2)


def test_digits_loaders():
    train, test = data.digits_loaders(100, image_size=16)
    xb, yb = next(iter(train))
    assert xb.shape == (100, 1, 16, 16) and not test.shuffle and train.shuffle


def test_synthetic_images():
    x, y = data.synthetic_images(2, 16, 5, channels_last=True)
    assert x.shape == (2, 3, 16, 16) and x.is_contiguous(memory_format=torch.channels_last)
    assert int(y.max()) < 5
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        data.synthetic_images(2, 16, 1)


@pytest.fixture
def image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls, n in (("cat", 3), ("dog", 2)):
        (tmp_path / cls).mkdir()
        for i in range(n):
            pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{i}.png")
    Image.fromarray(np.zeros((10, 10), dtype=np.uint8)).save(tmp_path / "dog" / "gray.png")
    return tmp_path


def test_image_folder_loader_reads_pngs(image_folder):
    loader = data.image_folder_loader(image_folder, image_size=16, batch_size=4, train=False)
    assert loader.dataset.classes == ["cat", "dog"]
    batches = list(loader)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.shape == (6, 3, 16, 16) and x.dtype == torch.float32
    assert y.tolist() == [0, 0, 0, 1, 1, 1]  # evaluation keeps order; grayscale became RGB


def test_image_folder_loader_training_shuffles_reproducibly(image_folder):
    def labels(seed):
        loader = data.image_folder_loader(image_folder, 16, batch_size=6, train=True, seed=seed)
        return next(iter(loader))[1].tolist()

    assert labels(3) == labels(3) and sorted(labels(3)) == [0, 0, 0, 1, 1, 1]


def test_image_folder_loader_trains_with_the_trainer(image_folder):
    from amp_lessons.train import trainer as T
    from amp_lessons.models import SmallCNN

    loader = data.image_folder_loader(image_folder, 16, batch_size=3)
    model = SmallCNN(in_channels=3, width=4, num_classes=2)
    t = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                  T.TrainConfig(precision="bf16", progress=False))
    t.fit(loader)
    assert t.step == 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(image_size=4), "image_size must be an integer >= 8"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(num_workers=-1), "num_workers must be an integer >= 0"),
])
def test_image_folder_loader_bad_arguments(image_folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        data.image_folder_loader(image_folder, **kwargs)


def test_image_folder_loader_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="root must be an existing folder"):
        data.image_folder_loader(tmp_path / "missing")
    with pytest.raises(ValueError, match="root must hold one subfolder of images per class"):
        data.image_folder_loader(tmp_path)


def test_image_transforms():
    from PIL import Image

    image = Image.fromarray(np.zeros((30, 40, 3), dtype=np.uint8))
    assert data.image_transforms(16, train=True)(image).shape == (3, 16, 16)
    assert data.image_transforms(16, train=False, channels=1)(image).shape == (1, 16, 16)
    with pytest.raises(ValueError, match="channels must be 1 or 3"):
        data.image_transforms(16, channels=2)


def test_torchvision_dataset_loader_checks_arguments_offline(tmp_path):
    with pytest.raises(ValueError, match="name must be one of CIFAR10, CIFAR100, MNIST"):
        data.torchvision_dataset_loader("ImageNet", tmp_path)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        data.torchvision_dataset_loader("CIFAR10", tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="download must be True or False"):
        data.torchvision_dataset_loader("CIFAR10", tmp_path, download="yes")
    with pytest.raises(ValueError, match=r"root must hold CIFAR10 \(or pass download=True\)"):
        data.torchvision_dataset_loader("CIFAR10", tmp_path)


# --- exact resume with every loader, and unreadable images ---------------------------------------

def _train_images(loader_factory, tmp_path, split_at=None, epochs=2):
    """Train 2 epochs on a fresh loader; with ``split_at``, stop after that many steps, save,
    and finish in a fresh trainer with a fresh loader (as a new process would)."""
    from amp_lessons.train import trainer as T
    from amp_lessons.models import SmallCNN

    def build():
        torch.manual_seed(0)
        model = SmallCNN(in_channels=3, width=4, num_classes=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return T.Trainer(model, opt, T.TrainConfig(progress=False, seed=None)), loader_factory()

    trainer, loader = build()
    if split_at is None:
        trainer.fit(loader, epochs=epochs)
        return trainer
    trainer.fit(loader, epochs=epochs, max_steps=split_at)
    trainer.save_checkpoint(tmp_path / "c.pt")
    torch.manual_seed(999)  # a new process: every generator elsewhere
    trainer, loader = build()
    trainer.load_checkpoint(tmp_path / "c.pt")
    trainer.fit(loader, epochs=epochs - trainer.epoch)
    return trainer


@pytest.mark.parametrize("split_at", [2, 3])  # at the epoch boundary, and inside epoch 2
def test_image_folder_loader_resumes_exactly(image_folder, tmp_path, split_at):
    factory = lambda: data.image_folder_loader(image_folder, 16, batch_size=3, seed=5)  # noqa: E731
    whole = _train_images(factory, tmp_path)
    resumed = _train_images(factory, tmp_path, split_at)
    assert whole.step == resumed.step == 4
    for (k, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert whole.history.columns()["loss"] == resumed.history.columns()["loss"]


def test_epoch_loader_order_depends_only_on_seed_and_epoch():
    ds = torch.utils.data.TensorDataset(torch.arange(20))
    first = data._epoch_loader(ds, 4, True, 0, seed=1)
    orders = []
    for epoch in (0, 1, 0):
        first.set_epoch(epoch)
        orders.append(torch.cat([b[0] for b in first]).tolist())
    assert orders[0] == orders[2] != orders[1] and sorted(orders[1]) == list(range(20))
    fresh = data._epoch_loader(ds, 4, True, 0, seed=1)
    fresh.set_epoch(1)  # a new process, straight to epoch 1
    assert torch.cat([b[0] for b in fresh]).tolist() == orders[1]
    sampler = data.EpochShuffleSampler(5, seed=2)
    sampler.set_epoch(3)
    assert sorted(sampler) == list(range(5)) and len(sampler) == 5


def test_a_truncated_image_is_named_in_the_error(image_folder):
    bad = image_folder / "cat" / "1.png"
    bad.write_bytes(bad.read_bytes()[:60])
    loader = data.image_folder_loader(image_folder, 16, batch_size=6, train=False)
    with pytest.raises(data.UnreadableImageError, match=r"cannot read image .*cat/1\.png"):
        list(loader)
    with pytest.raises(ValueError):  # a ValueError, as bad input is everywhere in the package
        data.read_image(str(bad))


def _png_header(width, height):
    """A PNG whose header claims ``width`` x ``height`` pixels (no pixel data follows)."""
    import struct
    import zlib

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                              0, 0, 0)) + chunk(b"IEND", b""))


def test_a_decompression_bomb_is_named_as_an_unreadable_image(image_folder):
    """A header claiming 20000 x 20000 pixels raised PIL's DecompressionBombError unnamed."""
    bomb = image_folder / "cat" / "bomb.png"
    bomb.write_bytes(_png_header(20000, 20000))
    with pytest.raises(data.UnreadableImageError,
                       match=r"cannot read image .*cat/bomb\.png: too many pixels"):
        data.read_image(str(bomb))
    loader = data.image_folder_loader(image_folder, 16, batch_size=8, train=False)
    with pytest.raises(data.UnreadableImageError, match=r"bomb\.png"):
        list(loader)


def test_set_loader_epoch_reaches_the_loader_or_its_sampler():
    from amp_lessons.data import set_loader_epoch

    class Sampler:
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    class WithSampler:
        def __init__(self):
            self.sampler = Sampler()

    direct, wrapped = Sampler(), WithSampler()
    set_loader_epoch(direct, 3)
    set_loader_epoch(wrapped, 4)
    set_loader_epoch([1, 2, 3], 5)  # a plain list has neither: nothing to tell
    assert (direct.epoch, wrapped.sampler.epoch) == (3, 4)


def test_tensor_batches_takes_every_valid_seed():
    for seed in (2**62, 2**63 - 1):
        batches = data.TensorBatches(torch.arange(10.).reshape(10, 1), torch.arange(10), 3,
                                     seed=seed)
        batches.set_epoch(7)
        assert sum(len(x) for x, _ in batches) == 10
        sampler = data.EpochShuffleSampler(10, seed)
        sampler.set_epoch(3)
        assert sorted(sampler) == list(range(10))
    for seed, epoch in ((0, 0), (0, 5), (1, 2), (42, 9)):  # unchanged for the seeds that fitted
        assert data.epoch_seed(seed, epoch) == seed * 100_003 + epoch
    x = torch.arange(10.).reshape(10, 1)
    order = [int(v) for xb, _ in data.TensorBatches(x, torch.arange(10), 10, seed=3) for v in xb]
    g = torch.Generator().manual_seed(3 * 100_003)
    assert order == torch.randperm(10, generator=g).tolist()


def test_epochs_and_sampler_settings_are_checked_not_truncated():
    """``set_epoch(1.7)`` was silently epoch 1 (a resumed run could reuse another epoch's
    order); strings and negative sizes gave int() or torch errors that named nothing."""
    tb = data.TensorBatches(torch.arange(6.0), torch.arange(6), 2)
    sampler = data.EpochShuffleSampler(5)
    loader = data.EpochDataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)),
                               sampler=data.EpochShuffleSampler(6), batch_size=2)
    for obj in (tb, sampler, loader):
        for bad in (1.7, "one", -1, None):
            with pytest.raises(ValueError, match="epoch must be a whole number >= 0"):
                obj.set_epoch(bad)
        obj.set_epoch(2)
    assert tb.epoch == sampler.epoch == loader.sampler.epoch == 2
    with pytest.raises(ValueError, match="n must be a whole number >= 0; got -1"):
        data.EpochShuffleSampler(-1)
    for make in (lambda: data.EpochShuffleSampler(4, seed="x"),
                 lambda: data.EpochDataLoader([1, 2], seed=-3)):
        with pytest.raises(ValueError, match="seed must be a whole number >= 0"):
            make()
