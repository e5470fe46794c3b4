"""Prepared boxes and masks against the real transforms.v2, on JPEGs of odd sizes with every EXIF orientation.

What a user of torchvision would write for the same job: PIL opens the file,
`ImageOps.exif_transpose` stands it up, then `v2.Resize(S)` (and
`v2.CenterCrop(S)` for `--mode center-crop`) on `tv_tensors.BoundingBoxes` and
`tv_tensors.Mask`. gpufeed's prepare must give the same boxes (within 0.5 px)
and the same masks (exactly). v2 runs in the cached torchvision venv
(`extra_venvs`); the files are written here.

The pixels too, on pictures of a bright rectangle whose box is their
annotation (`step_edges`), resized with v2.Resize's filter (bilinear), for
a JPEG output (the YCbCr path; v2's pixels stored as prepare stores them)
and a PNG one (the RGB path): close to v2's (PSNR), and each edge of the
rectangle where the prepared box says it is, as near as v2's own pixels
are to v2's box (a slip of pixels against boxes, which the box and mask
comparisons cannot see, shows here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from extra_venvs import venv_python
from PIL import Image
from test_transforms_v2 import TORCHVISION

from pipeline import EncodeSpec, PrepareSpec, ResizeSpec, prepare_dataset
from pipeline.targets import orient_boxes, orient_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from step_edges import edge_errors, halo, psnr, step_picture  # noqa: E402

SIZE = 64
SHAPES = [(203, 151), (151, 97)]  # odd sizes; stored width x height
# The pixel comparison's pictures: stored size and EXIF orientation (643x483 to 64 decodes DCT-scaled).
PIXEL_CASES = [
    ((203, 151), 1), ((203, 151), 6), ((151, 97), 3), ((151, 97), 8), ((643, 483), 1), ((643, 483), 5),
    ((203, 151), 2), ((151, 97), 4), ((643, 483), 7),
]  # fmt: skip
TURN_BACK = {  # what makes the stored raster of an upright picture, for each orientation (exif_transpose undoes it)
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}  # fmt: skip
PREPARE_MIN_PSNR_DB = 33.0  # measured: 36.4 dB at the least (JPEG), 39.3 (PNG); a slip of 0.4 px: 26-30
PREPARE_MAX_MEAN_ABS = 3.0  # measured: 2.3 at the most (JPEG), 1.0 (PNG); a slip of 0.4 px: 2.9-4.4
EDGE_MARGIN = 0.25  # px beyond v2's own error at the same edge (measured: 0.05 at the most)
MEAN_EDGE_MARGIN = 0.08  # px beyond v2's mean error over a picture's edges (measured: 0.00 at the most)
V2_SCRIPT = r"""
import io, json, sys
import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision import tv_tensors
from torchvision.transforms import v2

answers = []
for case in json.load(sys.stdin):
    image = ImageOps.exif_transpose(Image.open(case["image"]))
    width, height = image.size
    ops = [v2.Resize(case["size"])] + ([v2.CenterCrop(case["size"])] if case["mode"] == "center-crop" else [])
    pixels = tv_tensors.Image(torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1))
    boxes = tv_tensors.BoundingBoxes(case["boxes"], format="XYXY", canvas_size=(height, width))
    masks = [tv_tensors.Mask(torch.from_numpy(np.load(case["mask"])))] if "mask" in case else []
    out_pixels, out_boxes, *out_mask = v2.Compose(ops)(pixels, boxes, *masks)
    if out_mask:
        np.save(case["mask_out"], out_mask[0].numpy())
    if "pixels_out" in case:
        out = out_pixels.permute(1, 2, 0).numpy()
        if case.get("jpeg_quality"):  # stored as prepare stores it: Pillow's JPEG at that quality
            buffer = io.BytesIO()
            Image.fromarray(out).save(buffer, "JPEG", quality=case["jpeg_quality"])
            out = np.asarray(Image.open(buffer).convert("RGB"))
        np.save(case["pixels_out"], out)
    answers.append({"boxes": out_boxes.tolist(), "size": [out_pixels.shape[2], out_pixels.shape[1]]})
print(json.dumps(answers))
"""


def write_case(folder: Path, stem: str, stored: tuple[int, int], orientation: int) -> tuple[Path, list[list[float]], np.ndarray]:
    """A JPEG stored `stored` with EXIF `orientation`, boxes in its upright pixels, and its mask (upright, 1-px stripes)."""
    width, height = stored
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels = (np.random.default_rng(orientation).integers(0, 255, (height, width, 3))).astype(np.uint8)
    path = folder / f"{stem}.jpg"
    Image.fromarray(pixels).save(path, "JPEG", quality=90, exif=exif)
    upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    uw, uh = upright
    boxes = [
        [10.0, 12.0, 70.5, 60.25],  # a box inside
        [0.0, 0.0, 7.0, float(uh)],  # touching the left, top and bottom edges
        [uw - 2.0, uh - 3.0, float(uw), float(uh)],  # tiny, in the corner
        [uw / 2 - 1, uh / 2 - 1, uw / 2 + 1, uh / 2 + 1],  # tiny, in the middle
    ]
    mask = np.zeros((uh, uw), np.uint8)
    mask[:, ::2] = 1  # 1-px stripes: any half-pixel slip of the sampling shows
    mask[::3, :] = 2
    return path, boxes, mask


def stored_boxes(boxes: list[list[float]], orientation: int, upright: tuple[int, int]) -> list[list[float]]:
    """The boxes in the stored file's pixels (COCO with its stored size declared): the upright ones turned back."""
    back = {6: 8, 8: 6}.get(orientation, orientation)
    return orient_boxes(np.array(boxes, np.float64), back, *upright).tolist()


@pytest.mark.parametrize("mode", ["shorter", "center-crop"])
def test_prepared_boxes_and_masks_equal_v2(tmp_path: Path, mode: str) -> None:
    python = venv_python("vision", TORCHVISION)
    src = tmp_path / "coco"
    src.mkdir()
    (tmp_path / "masks").mkdir()
    images, annotations, cases, masks = [], [], [], {}
    for number, (stored, orientation) in enumerate((s, o) for s in SHAPES for o in range(1, 9)):
        stem = f"{number:03d}"
        path, boxes, mask = write_case(src, stem, stored, orientation)
        upright = (mask.shape[1], mask.shape[0])
        # Both frames a tool may write, each with its own declared size; where the sizes cannot tell
        # (orientations 1-4 keep the size) the boxes are upright, label_frame's default.
        in_stored = orientation >= 5 and number % 2 == 1
        declared = stored if in_stored else upright
        in_file = stored_boxes(boxes, orientation, upright) if in_stored else boxes
        images.append({"id": number, "file_name": path.name, "width": declared[0], "height": declared[1]})
        for k, (x0, y0, x1, y1) in enumerate(in_file):
            annotations.append({"id": number * 10 + k, "image_id": number, "category_id": 1, "iscrowd": 0,
                                "bbox": [x0, y0, x1 - x0, y1 - y0]})  # fmt: skip
        np.save(tmp_path / "masks" / f"{stem}.npy", mask)
        masks[path.name] = mask
        cases.append({"image": str(path), "boxes": boxes, "mask": str(tmp_path / "masks" / f"{stem}.npy"),
                      "mask_out": str(tmp_path / "masks" / f"{stem}-v2.npy"), "mode": mode, "size": SIZE})  # fmt: skip
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]}
    (src / "instances.json").write_text(json.dumps(coco))
    done = subprocess.run([str(python), "-c", V2_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    out = tmp_path / "out"
    spec = PrepareSpec(str(src / "instances.json"), str(out), resize=ResizeSpec(size=SIZE, mode=mode), min_visible=0.0)
    prepare_dataset(spec, workers=0)
    samples = _samples(out)
    for case, answer in zip(cases, answers):
        name = Path(case["image"]).name
        sample = samples[name]
        assert list(sample["size"]) == answer["size"], name
        want = np.array(answer["boxes"], np.float64)
        kept = want[(want[:, 2] > want[:, 0]) & (want[:, 3] > want[:, 1])]  # v2 keeps degenerate boxes; we drop them
        got = np.sort(sample["boxes"], axis=0)
        assert got.shape == kept.shape and np.abs(got - np.sort(kept, axis=0)).max() < 0.5, (name, got, kept)
    # The same pictures as a segmentation folder, each mask stored as its image is (turned back from upright):
    # the prepared masks are v2's, pixel for pixel.
    seg = tmp_path / "seg"
    (seg / "images").mkdir(parents=True)
    (seg / "masks").mkdir()
    for case in cases:
        name = Path(case["image"]).name
        (seg / "images" / name).write_bytes(Path(case["image"]).read_bytes())
        orientation = Image.open(case["image"]).getexif().get(0x0112, 1)
        back = {6: 8, 8: 6}.get(orientation, orientation)
        Image.fromarray(orient_mask(masks[name], back)).save(seg / "masks" / f"{Path(name).stem}.png")
    prepare_dataset(PrepareSpec(str(seg), str(tmp_path / "seg-out"), resize=ResizeSpec(size=SIZE, mode=mode)), workers=0)
    prepared = _samples(tmp_path / "seg-out")
    for case in cases:
        name = Path(case["image"]).name
        np.testing.assert_array_equal(prepared[name]["mask"], np.load(case["mask_out"]), err_msg=f"{name} ({mode})")


@pytest.fixture(scope="module")
def pixels_v2(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[dict]]:
    """Per (mode, format), each picture of PIXEL_CASES as prepared beside v2's pixels and boxes for it.

    The pictures are bright rectangles (`step_edges.step_picture`) drawn
    upright and stored turned back, with their EXIF orientation; each
    rectangle's box is the picture's one annotation. Prepare resizes with
    "bilinear" (v2.Resize's default filter); v2's pixels for a JPEG output
    are stored the way prepare stores them (Pillow's JPEG at the same
    quality) before they are compared.
    """
    python = venv_python("vision", TORCHVISION)
    base = tmp_path_factory.mktemp("pixels-v2")
    src = base / "coco"
    src.mkdir()
    quality = EncodeSpec().quality
    images, annotations, cases = [], [], []
    for number, ((width, height), orientation) in enumerate(PIXEL_CASES):
        uw, uh = (height, width) if orientation >= 5 else (width, height)
        rect_w, rect_h = int(uw * 0.45), int(uh * 0.45)
        x0, y0 = (uw - rect_w) // 2 + number % 3 - 1, (uh - rect_h) // 2 + number % 2  # whole pixels, off-centre
        rect = (x0, y0, x0 + rect_w, y0 + rect_h)
        stored = Image.fromarray(step_picture(uw, uh, rect, number))
        if orientation in TURN_BACK:
            stored = stored.transpose(TURN_BACK[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = src / f"{number:03d}.jpg"
        stored.save(path, "JPEG", quality=95, exif=exif)
        images.append({"id": number, "file_name": path.name, "width": uw, "height": uh})
        annotations.append({"id": number, "image_id": number, "category_id": 1, "iscrowd": 0,
                            "bbox": [x0, y0, rect_w, rect_h]})  # fmt: skip
        for mode in ("shorter", "center-crop"):
            for fmt in ("png", "jpeg"):
                cases.append({"image": str(path), "boxes": [[float(v) for v in rect]], "mode": mode, "size": SIZE,
                              "pixels_out": str(base / f"{number:03d}-{mode}-{fmt}-v2.npy"),
                              "jpeg_quality": quality if fmt == "jpeg" else None, "upright": (uw, uh)})  # fmt: skip
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]}
    (src / "instances.json").write_text(json.dumps(coco))
    done = subprocess.run([str(python), "-c", V2_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[tuple[str, str], list[dict]] = {}
    prepared = {}
    for case, answer in zip(cases, json.loads(done.stdout)):
        mode, fmt = case["mode"], "jpeg" if case["jpeg_quality"] else "png"
        if (mode, fmt) not in prepared:
            out = base / f"out-{mode}-{fmt}"
            resize = ResizeSpec(size=SIZE, mode=mode, resample="bilinear")
            spec = PrepareSpec(str(src / "instances.json"), str(out), resize=resize, encode=EncodeSpec(format=fmt))
            prepare_dataset(spec, workers=0)
            prepared[mode, fmt] = _samples(out)
        sample = prepared[mode, fmt][Path(case["image"]).name]
        found.setdefault((mode, fmt), []).append({
            "name": Path(case["image"]).name, "upright": case["upright"], "pixels": sample["image"],
            "boxes": sample["boxes"], "v2_pixels": np.load(case["pixels_out"]), "v2_boxes": answer["boxes"],
        })  # fmt: skip
    return found


@pytest.mark.parametrize("picture", range(len(PIXEL_CASES)), ids=[f"{w}x{h}-exif{o}" for (w, h), o in PIXEL_CASES])
@pytest.mark.parametrize("fmt", ["jpeg", "png"])
@pytest.mark.parametrize("mode", ["shorter", "center-crop"])
def test_prepared_pixels_agree_with_v2(
    pixels_v2: dict[tuple[str, str], list[dict]], mode: str, fmt: str, picture: int
) -> None:
    """The prepared picture is close to v2's (PSNR, mean absolute difference), and each edge of its
    rectangle lies where the prepared box says, no further off than v2's pixels are from v2's box plus
    EDGE_MARGIN (each edge) and MEAN_EDGE_MARGIN (on average): half a pixel of slip fails."""
    case = pixels_v2[mode, fmt][picture]
    ours, theirs, (uw, uh) = case["pixels"], case["v2_pixels"], case["upright"]
    assert ours.shape == theirs.shape, case["name"]
    ratio = psnr(ours, theirs)
    mean_abs = float(np.abs(ours.astype(int) - theirs.astype(int)).mean())
    assert ratio > PREPARE_MIN_PSNR_DB and mean_abs < PREPARE_MAX_MEAN_ABS, (case["name"], ratio, mean_abs)
    zoom = SIZE / min(uw, uh)  # the shorter side becomes SIZE
    region = (0, 0, ours.shape[1], ours.shape[0])
    mine = edge_errors(ours, tuple(case["boxes"][0]), region, zoom, halo(uw, uh) * zoom)
    v2s = edge_errors(theirs, tuple(case["v2_boxes"][0]), region, zoom, halo(uw, uh) * zoom)
    assert set(mine) == set(v2s) == {"x0", "y0", "x1", "y1"}, (case["name"], mine, v2s)
    for edge, error in mine.items():
        assert abs(error) <= abs(v2s[edge]) + EDGE_MARGIN, (case["name"], edge, error, v2s[edge])
    ours_mean, theirs_mean = np.mean(np.abs(list(mine.values()))), np.mean(np.abs(list(v2s.values())))
    assert ours_mean <= theirs_mean + MEAN_EDGE_MARGIN, (case["name"], mine, v2s)


def _samples(out: Path) -> dict[str, dict]:
    import io
    import tarfile

    found: dict[str, dict] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
        for parts in members.values():
            meta = json.loads(parts["json"])
            found[Path(meta["source"]).name] = {
                "size": meta["size"],
                "boxes": np.load(io.BytesIO(parts["boxes.npy"])).astype(np.float64) if "boxes.npy" in parts else None,
                "mask": np.asarray(Image.open(io.BytesIO(parts["mask.png"]))) if "mask.png" in parts else None,
                "image": next((_rgb(parts[ext]) for ext in ("jpg", "png") if ext in parts), None),
            }
    return found


def _rgb(data: bytes) -> np.ndarray:
    """A stored picture's pixels, (H, W, 3) uint8."""
    import io

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
