"""Pixels where their boxes are: every path that decodes a JPEG at a reduced DCT scale maps by M/8 exactly.

libjpeg's scaled IDCT makes each 8x8 block M x M pixels and rounds the
scaled size up, so mapping by the ratio of the sizes stretches the picture
toward the right and bottom (up to 0.9 px at 1/8). The scene: a 643x483
JPEG, dark left of x = 520 and bright from it, with a box whose left edge
is at x = 520; the output's edge is found to a fraction of a pixel.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, make_loader, prepare_dataset
from pipeline.decode import decoded_extent, decoded_scale

WIDTH, HEIGHT, EDGE = 643, 483, 520
FLOOR_PX = 0.3  # how well a blurred step edge is located here (resampling, JPEG ringing); the error was 0.66


def step_jpeg(path: Path, width: int = WIDTH, height: int = HEIGHT) -> None:
    pixels = np.full((height, width, 3), 30, np.uint8)
    pixels[:, EDGE:] = 220
    Image.fromarray(pixels).save(path, "JPEG", quality=98, subsampling=0)


def edge_at(row: np.ndarray) -> float:
    """Where a dark-to-bright step crosses half way, in continuous coordinates (pixel u spans [u, u + 1])."""
    level = (float(row.min()) + float(row.max())) / 2
    u = int(np.argmax(row >= level))
    before, after = float(row[u - 1]), float(row[u])
    return (u - 1) + (level - before) / (after - before) + 0.5


def test_decoded_scale_is_the_eighths_of_a_dct_scaled_size():
    assert decoded_scale(643, 483, 242, 182) == (3 / 8, 3 / 8)  # ceil(643 * 3/8) = 242, not 643 * 3/8
    assert decoded_scale(643, 483, 643, 483) == (1.0, 1.0)
    assert decoded_scale(640, 480, 300, 200) == (300 / 640, 200 / 480)  # no M/8 size: the ratio


def test_the_slack_of_a_scaled_decode_comes_first_on_an_axis_its_orientation_reversed():
    # 643x483 at 3/8 decodes 242x182: 0.875 px of slack past 643 * 3/8, 0.875 past 483 * 3/8
    assert decoded_extent(643, 483, 242, 182, 1) == (0.0, 0.0, 3 / 8, 3 / 8)
    assert decoded_extent(643, 483, 242, 182, 2) == (0.875, 0.0, 3 / 8, 3 / 8)  # mirrored: x reversed
    assert decoded_extent(643, 483, 242, 182, 4) == (0.0, 0.875, 3 / 8, 3 / 8)  # flipped: y reversed
    assert decoded_extent(643, 483, 242, 182, 3)[:2] == decoded_extent(643, 483, 242, 182, 7)[:2] == (0.875, 0.875)
    assert decoded_extent(643, 483, 242, 182, 6)[:2] == (0.875, 0.0) and decoded_extent(643, 483, 242, 182, 8)[:2] == (0.0, 0.875)
    assert decoded_extent(643, 483, 242, 182, 5)[:2] == (0.0, 0.0)
    assert decoded_extent(640, 480, 300, 200, 3)[:2] == (0.0, 0.0)  # no M/8 size: the ratio, no slack


@pytest.mark.parametrize("orientation", [1, 2])
def test_an_augmented_view_of_a_mirrored_photo_keeps_the_edge_on_its_box(tmp_path: Path, orientation: int) -> None:
    # A variant (no rotation, no flip, the whole picture) resamples a DCT-scaled decode turned upright:
    # mirrored (EXIF 2), the decode's slack lies at the left, and the edge must still land where the
    # variant's geometry puts it.
    import json
    import tarfile

    from pipeline import AugmentSpec

    (tmp_path / "src").mkdir()
    pixels = np.full((HEIGHT, WIDTH, 3), 30, np.uint8)
    pixels[:, :EDGE] = 220  # stored mirrored: upright, the bright part starts at WIDTH - EDGE
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels if orientation == 2 else pixels[:, ::-1]).save(
        tmp_path / "src" / "a.jpg", "JPEG", quality=98, subsampling=0, exif=exif
    )
    augment = AugmentSpec(variants=1, scale=(1.0, 1.0), ratio=(WIDTH / HEIGHT, WIDTH / HEIGHT), flip=False, jitter=0.0,
                          rotate=0.0)  # fmt: skip
    spec = PrepareSpec(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeSpec(size=120, mode="shorter"),
                       augment=augment)  # fmt: skip
    prepare_dataset(spec, workers=0)
    [shard] = sorted((tmp_path / "out" / "v0").glob("shard-*.tar"))  # the variant's set
    with tarfile.open(shard) as tar:
        members = {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
    image = np.asarray(Image.open(io.BytesIO(members["jpg"])).convert("L"), np.float64)
    ops = json.loads(members["json"])["ops"]
    crop = next(op for op in ops if op["op"] == "random_resized_crop")
    (cx, _), (cw, _) = crop["center"], crop["size"]
    expected = (WIDTH - EDGE - (cx - cw / 2)) * image.shape[1] / cw
    assert abs(edge_at(image[image.shape[0] // 2]) - expected) < FLOOR_PX, (orientation, edge_at(image[image.shape[0] // 2]), expected)


@pytest.mark.parametrize("mode", ["pad", "shorter", "center-crop"])
def test_prepare_keeps_the_edge_on_its_box(tmp_path: Path, mode: str) -> None:
    # pad takes the RGB path (a DCT-scaled decode, then a resize); the others the YCbCr path
    (tmp_path / "src").mkdir()
    step_jpeg(tmp_path / "src" / "a.jpg")
    spec = PrepareSpec(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeSpec(size=224, mode=mode))
    prepare_dataset(spec, workers=0)
    import tarfile

    [shard] = sorted((tmp_path / "out").glob("shard-*.tar"))
    with tarfile.open(shard) as tar:
        data = next(tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg"))  # type: ignore[union-attr]
    image = np.asarray(Image.open(io.BytesIO(data)).convert("L"), np.float64)
    row = image[image.shape[0] // 2]
    x0, y0, x1, y1 = _geometry_box(spec, mode)
    expected = (EDGE - x0) * image.shape[1] / (x1 - x0) if mode != "pad" else EDGE * 224 / WIDTH
    assert abs(edge_at(row) - expected) < FLOOR_PX, (edge_at(row), expected)


def _geometry_box(spec: PrepareSpec, mode: str) -> tuple[float, float, float, float]:
    from pipeline.prepare.transforms import center_crop_box

    if mode == "center-crop":
        return center_crop_box(spec.resize, WIDTH, HEIGHT)[0]
    return 0.0, 0.0, float(WIDTH), float(HEIGHT)


@pytest.mark.parametrize("decoder", ["region", "simplejpeg", "pil"])
def test_the_loaders_decoders_keep_the_edge_on_its_box(tmp_path: Path, decoder: str) -> None:
    # An eval crop of a 641x641 photo to 32 px decodes at 1/8 on every decoder: 641 / 8 = 80.125 is stored as
    # 81 columns, which the sizes' ratio would stretch by 0.7 scaled px at the edge (0.33 px of the output).
    src = tmp_path / "src"
    src.mkdir()
    step_jpeg(src / "a.jpg", 641, 641)
    prepare_dataset(PrepareSpec(str(src), str(tmp_path / "out"), resize=ResizeSpec(size=64, mode="none")), workers=0)
    loader = make_loader(str(tmp_path / "out"), 1, device="cpu", crop=32, num_workers=1, train=False, dtype="uint8", decoder=decoder)
    image = next(iter(loader))[0][0].numpy().mean(axis=0)
    from pipeline.loader.crops import CropSpec, centre_crop_box

    left, _, side, _ = centre_crop_box(641, 641, CropSpec(32, False))
    expected = (EDGE - left) * 32 / side
    assert 20 < expected < 30  # inside the crop, clear of its border
    assert abs(edge_at(image[16]) - expected) < 0.15, (edge_at(image[16]), expected)
