"""A user's images for ``qnn-convbwd finetune``: read, checked, resized, normalised.

* ``image_folder``: torchvision's ``ImageFolder`` layout (``root/<class>/<image>``,
  classes in sorted folder order, files with an image extension), each image read
  with Pillow as RGB and resized to ``size`` x ``size`` (bilinear);
* ``tensor_file``: a ``.pt`` (``torch.save`` of a dict) or ``.npz`` holding ``x``
  (N, C, H, W) images, C 1 or 3, uint8 0..255 or float 0..1, and ``y`` integer
  labels 0..classes-1;
* ``holdout``: a seeded random share of a data set held out;
* ``Normalize``: per-channel mean and standard deviation over the training
  images' [0, 1] pixels, applied as ``(x - mean) / std``.

Every reading problem raises ``DataError`` naming the file or folder and the reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

# The file endings torchvision's ImageFolder accepts.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
TENSOR_SUFFIXES = (".pt", ".npz")


class DataError(ValueError):
    """Input data that cannot be used; the message names the file or folder and why."""


@dataclasses.dataclass
class Dataset:
    x: torch.Tensor  # (N, 3, size, size) float32
    y: torch.Tensor  # (N,) int64, 0 .. len(classes) - 1
    classes: list[str]

    def __len__(self) -> int:
        return len(self.y)


def load(path: str | Path, size: int, classes: list[str] | None = None) -> Dataset:
    """A folder (``image_folder``) or a tensor file (``tensor_file``). ``classes``: the
    training data's class names, which held-out data must use."""
    path = Path(path)
    if path.is_dir():
        return image_folder(path, size, classes)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.suffix not in TENSOR_SUFFIXES:
        raise DataError(
            f"{path}: neither a folder of class folders nor a {' or '.join(TENSOR_SUFFIXES)} file"
        )
    return tensor_file(path, size, classes)


def _read_image(path: Path, size: int) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise DataError(f"{path}: not a readable image ({err})") from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(size, size, 3).permute(2, 0, 1).float() / 255.0


def image_folder(root: Path, size: int, classes: list[str] | None = None) -> Dataset:
    """Images under ``root/<class>/``, labelled by their folder's index in sorted order
    (``classes``' order when given: held-out data labelled as the training data)."""
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise DataError(f"{root}: no class folders (expected {root}/<class>/<image>)")
    names = [p.name for p in folders]
    if classes is not None:
        unknown = [n for n in names if n not in classes]
        if unknown:
            raise DataError(f"{root}: classes not in the training data: {unknown}")
    index = {name: i for i, name in enumerate(classes if classes is not None else names)}
    images, labels = [], []
    for folder in folders:
        files = sorted(
            p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not files:
            raise DataError(
                f"{folder}: class folder without images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        for file in files:
            images.append(_read_image(file, size))
            labels.append(index[folder.name])
    return Dataset(torch.stack(images), torch.tensor(labels, dtype=torch.int64), list(index))


def tensor_file(path: Path, size: int, classes: list[str] | None = None) -> Dataset:
    """``x`` and ``y`` from a ``.pt`` or ``.npz`` file; images resized to ``size``
    (bilinear) when they have another size, grey ones repeated over 3 channels."""
    try:
        if path.suffix == ".npz":
            import numpy as np

            with np.load(path, allow_pickle=False) as stored:
                found = {k: torch.from_numpy(stored[k]) for k in ("x", "y") if k in stored}
        else:
            stored = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(stored, dict):
                raise DataError(f"{path}: holds a {type(stored).__name__}, not a dict of x and y")
            found = {k: torch.as_tensor(stored[k]) for k in ("x", "y") if k in stored}
    except DataError:
        raise
    except Exception as err:  # a truncated or foreign file: pickle, zip or numpy errors
        raise DataError(f"{path}: not readable ({type(err).__name__}: {err})") from None
    missing = [k for k in ("x", "y") if k not in found]
    if missing:
        raise DataError(f"{path}: no tensor {' or '.join(missing)}")
    x, y = found["x"], found["y"]
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise DataError(f"{path}: x has shape {tuple(x.shape)}, not (N, 1 or 3, H, W)")
    if y.dim() != 1 or len(y) != len(x) or y.dtype.is_floating_point or len(y) == 0:
        raise DataError(
            f"{path}: y must be {len(x)} integer labels, one per image (got {y.dtype} "
            f"{tuple(y.shape)})"
        )
    y = y.to(torch.int64)
    count = len(classes) if classes is not None else int(y.max()) + 1
    if int(y.min()) < 0 or int(y.max()) >= count:
        raise DataError(f"{path}: labels outside 0..{count - 1}")
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    elif x.dtype.is_floating_point:
        x = x.float()
        if float(x.min()) < 0.0 or float(x.max()) > 1.0:
            raise DataError(f"{path}: float x must hold pixels in [0, 1]")
    else:
        raise DataError(f"{path}: x is {x.dtype}; uint8 (0..255) or float (0..1) expected")
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if tuple(x.shape[2:]) != (size, size):
        x = torch.nn.functional.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False
        ).clamp(0.0, 1.0)
    names = classes if classes is not None else [str(i) for i in range(count)]
    return Dataset(x.contiguous(), y, list(names))


def holdout(data: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(kept, held out): ``fraction`` of ``data`` (at least one sample) drawn by a
    permutation from ``seed``."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"--val-split {fraction}: a fraction between 0 and 1")
    held = max(1, round(fraction * len(data)))
    if held >= len(data):
        raise DataError(f"--val-split {fraction} leaves no training data of {len(data)} samples")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    kept, out = order[held:], order[:held]
    return (
        Dataset(data.x[kept], data.y[kept], data.classes),
        Dataset(data.x[out], data.y[out], data.classes),
    )


@dataclasses.dataclass
class Normalize:
    """``(x - mean) / std`` per channel, on [0, 1] pixels."""

    mean: list[float]
    std: list[float]

    @classmethod
    def identity(cls, channels: int = 3) -> Normalize:
        return cls([0.0] * channels, [1.0] * channels)

    @classmethod
    def of(cls, x: torch.Tensor) -> Normalize:
        """The per-channel mean and standard deviation of images ``x`` (a constant channel
        keeps std 1)."""
        mean = x.mean(dim=(0, 2, 3))
        std = x.std(dim=(0, 2, 3))
        std = torch.where(std > 0, std, torch.ones_like(std))
        return cls([float(v) for v in mean], [float(v) for v in std])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return (x - mean) / std
