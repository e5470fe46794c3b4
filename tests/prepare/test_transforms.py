"""Resize modes and seeded pre-augmentation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.decode import decode_image
from pipeline.prepare.transforms import (
    PAD_FILL,
    augment_image,
    output_size,
    required_scale,
    resize_image,
    variant_rng,
)
from pipeline.specs import RESIZE_MODES, AugmentSpec, ResizeSpec

S = 64


def _gradient(width: int, height: int) -> Image.Image:
    """An RGB image whose pixels say where they are (so crops and flips are visible)."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    rgb = np.stack([x, y, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def _white(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (255, 255, 255))


def _expected_size(mode: str, width: int, height: int, size: int, upscale: bool) -> tuple[int, int]:
    if mode == "none":
        return width, height
    if mode in ("center-crop", "pad"):
        if mode == "pad":
            return size, size
        shorter = min(width, height)
        side = size if (upscale or shorter >= size) else shorter
        return side, side
    # transforms.v2's rule: the side asked for is exactly `size`, the other truncated (int(size * long / short))
    short, long = min(width, height), max(width, height)
    if (short if mode == "shorter" else long) <= size and not upscale:
        return width, height
    if mode == "shorter":
        new_short, new_long = size, int(size * long / short)
    else:
        new_short, new_long = int(size * short / long), size
    new_short, new_long = max(1, new_short), max(1, new_long)  # a 1-px strip stays 1 px
    return (new_short, new_long) if width <= height else (new_long, new_short)


@pytest.mark.parametrize(
    ("mode", "size", "expected"),
    [("shorter", 224, (299, 224)), ("longer", 300, (300, 224)), ("center-crop", 224, (224, 224))],
)
def test_output_sizes_follow_transforms_v2_integer_rule(mode, size, expected):
    # v2.Resize(224) makes 641x479 into 299x224 (int(224 * 641 / 479) = 299.76 truncated), not 300x224
    img, _ = resize_image(_gradient(641, 479), (641, 479), ResizeSpec(size=size, mode=mode))
    assert img.size == expected


def test_center_crop_anchors_round_as_v2():
    # v2: Resize(224) -> 299x224, then CenterCrop(224) at left int(round((299 - 224) / 2)) = 38 (not 37.5)
    from pipeline.prepare.transforms import center_crop_box

    box, side = center_crop_box(ResizeSpec(size=224, mode="center-crop"), 641, 479)
    scale = 641 / 299
    assert side == 224 and box == pytest.approx((38 * scale, 0.0, (38 + 224) * scale, 479.0))
    # no resize (already the size): an integer crop, its anchor rounded half to even as Python's round
    box, side = center_crop_box(ResizeSpec(size=224, mode="center-crop"), 225, 224)
    assert side == 224 and box == (0.0, 0.0, 224.0, 224.0)
    box, _ = center_crop_box(ResizeSpec(size=224, mode="center-crop"), 227, 224)
    assert box == (2.0, 0.0, 226.0, 224.0)  # round(1.5) = 2


SHAPES = {
    "landscape": (320, 200),
    "portrait": (200, 320),
    "square": (150, 150),
    "small": (40, 30),
    "small-portrait": (30, 40),
    "exact": (S, 100),
    "tall-strip": (70, 700),
}


# ---------------------------------------------------------------------------
# Resize modes


@pytest.mark.parametrize(
    ("mode", "shape", "expected"),
    [
        ("shorter", "landscape", (102, S)),
        ("shorter", "portrait", (S, 102)),
        ("shorter", "square", (S, S)),
        ("shorter", "small", (40, 30)),
        ("shorter", "exact", (S, 100)),
        ("longer", "landscape", (S, 40)),
        ("longer", "portrait", (40, S)),
        ("longer", "small", (40, 30)),
        ("longer", "tall-strip", (6, S)),
        ("center-crop", "landscape", (S, S)),
        ("center-crop", "portrait", (S, S)),
        ("center-crop", "small", (30, 30)),
        ("pad", "landscape", (S, S)),
        ("pad", "portrait", (S, S)),
        ("pad", "small", (S, S)),
        ("none", "landscape", (320, 200)),
        ("none", "small", (40, 30)),
    ],
)
def test_resize_output_size(mode, shape, expected):
    width, height = SHAPES[shape]
    img, op = resize_image(_gradient(width, height), (width, height), ResizeSpec(size=S, mode=mode))
    assert img.size == expected
    assert img.mode == "RGB"
    assert op == {"op": "resize", "mode": mode, "size": S}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("shorter", (85, S)), ("longer", (S, 48)), ("center-crop", (S, S)), ("pad", (S, S)), ("none", (40, 30))],
)
def test_upscale_only_when_asked(mode, expected):
    img, _ = resize_image(_gradient(40, 30), (40, 30), ResizeSpec(size=S, mode=mode, upscale=True))
    assert img.size == expected


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("upscale", [False, True])
def test_resize_size_rule(mode, shape, upscale):
    width, height = SHAPES[shape]
    img, _ = resize_image(_gradient(width, height), (width, height), ResizeSpec(size=S, mode=mode, upscale=upscale))
    assert img.size == _expected_size(mode, width, height, S, upscale)
    if mode == "shorter" and (upscale or min(width, height) > S):
        assert min(img.size) == S
    if mode in ("longer", "pad", "center-crop"):
        assert max(img.size) <= S


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("shape", ["landscape", "portrait", "small", "tall-strip"])
@pytest.mark.parametrize("factor", [2, 4, 8])
def test_output_size_does_not_depend_on_pre_reduction(mode, shape, factor):
    width, height = SHAPES[shape]
    full = _gradient(width, height)
    reduced = full.reduce(factor)  # what a DCT-scaled decode hands over
    resize = ResizeSpec(size=S, mode=mode)
    a, _ = resize_image(full, (width, height), resize)
    b, _ = resize_image(reduced, (width, height), resize)
    assert a.size == b.size


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("size", [(640, 480), (480, 640), (641, 479)])
def test_output_size_same_for_a_real_dct_scaled_jpeg(mode, size):
    buffer = io.BytesIO()
    _gradient(*size).save(buffer, "JPEG", quality=90)
    data = buffer.getvalue()
    resize = ResizeSpec(size=S, mode=mode)
    full = decode_image(data)
    scaled = decode_image(data, scale_for=lambda w, h: required_scale(resize, AugmentSpec(), w, h))
    if mode != "none":
        assert scaled.image.width < full.image.width  # the decoder really did reduce
    assert scaled.original_size == full.original_size == size
    a, _ = resize_image(full.image, full.original_size, resize)
    b, _ = resize_image(scaled.image, scaled.original_size, resize)
    assert a.size == b.size
    diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
    assert diff.mean() < 6  # and the same picture


def test_pad_centres_the_picture_on_black():
    img, _ = resize_image(_white(320, 200), (320, 200), ResizeSpec(size=S, mode="pad"))
    assert PAD_FILL == (0, 0, 0)
    pixels = np.asarray(img)
    assert img.size == (S, S)
    # 320x200 -> 64x40, pasted at y = 12: 12 black rows above, 12 below.
    assert (pixels[:12] == 0).all()
    assert (pixels[-12:] == 0).all()
    assert (pixels[12:52] > 240).all()


def test_pad_centres_a_small_portrait_without_upscaling():
    img, _ = resize_image(_white(30, 40), (30, 40), ResizeSpec(size=S, mode="pad"))
    pixels = np.asarray(img)
    assert img.size == (S, S)
    columns = np.nonzero(pixels.max(axis=(0, 2)))[0]
    rows = np.nonzero(pixels.max(axis=(1, 2)))[0]
    assert (columns[0], columns[-1]) == (17, 46)  # 30 px wide, centred in 64
    assert (rows[0], rows[-1]) == (12, 51)  # 40 px tall
    assert (pixels[12:52, 17:47] == 255).all()


def test_center_crop_takes_the_centre():
    # Left third red, middle white, right third blue: the centre crop is all white.
    rgb = np.zeros((200, 600, 3), np.uint8)
    rgb[:, :200] = (255, 0, 0)
    rgb[:, 200:400] = (255, 255, 255)
    rgb[:, 400:] = (0, 0, 255)
    img, _ = resize_image(Image.fromarray(rgb), (600, 200), ResizeSpec(size=S, mode="center-crop"))
    pixels = np.asarray(img).astype(int)
    assert img.size == (S, S)
    assert (pixels[:, 2:-2] > 230).all()


def test_none_is_unchanged():
    src = _gradient(123, 77)
    img, _ = resize_image(src, (123, 77), ResizeSpec(size=S, mode="none"))
    assert img.tobytes() == src.tobytes()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.integers(8, 1024),
    st.sampled_from(["shorter", "longer", "center-crop", "pad"]),
    st.booleans(),
)
def test_output_size_rule(width, height, size, mode, upscale):
    out_w, out_h = output_size(ResizeSpec(size=size, mode=mode, upscale=upscale), width, height)
    reference = min(width, height) if mode in ("shorter", "center-crop") else max(width, height)
    if reference > size or upscale:
        got = min(out_w, out_h) if mode in ("shorter", "center-crop") else max(out_w, out_h)
        assert got == size
    else:
        assert (out_w, out_h) == (width, height)
    assert out_w >= 1 and out_h >= 1


@pytest.mark.parametrize("mode", ["shorter", "longer", "center-crop", "pad"])
def test_required_scale_never_loses_needed_pixels(mode):
    resize = ResizeSpec(size=S, mode=mode)
    for width, height in SHAPES.values():
        scale = required_scale(resize, AugmentSpec(), width, height)
        assert 0 < scale <= 1
        target = output_size(resize, width, height)
        assert width * scale >= target[0] - 1 and height * scale >= target[1] - 1
    assert required_scale(ResizeSpec(size=S, mode="none"), AugmentSpec(), 4000, 3000) == 1.0


# ---------------------------------------------------------------------------
# Augmentation


AUG = AugmentSpec(variants=4)


def _augment(img, original, mode="shorter", augment=AUG, seed=0, key="k", variant=0, size=S, upscale=False):
    return augment_image(img, original, ResizeSpec(size=size, mode=mode, upscale=upscale), augment,
                         variant_rng(seed, key, variant))


def test_variant_rng_is_deterministic_and_distinct():
    def draw(*args):
        return variant_rng(*args).random(4).tolist()

    assert draw(0, "k", 0) == draw(0, "k", 0)
    assert draw(2**63 - 1, "été", 3) == draw(2**63 - 1, "été", 3)
    streams = {tuple(draw(seed, key, v)) for seed in (0, 1, 2**40) for key in ("a", "b", "a_b") for v in range(4)}
    assert len(streams) == 3 * 3 * 4


def test_augment_is_deterministic():
    src = _gradient(320, 240)
    a, ops_a = _augment(src, (320, 240), seed=5, key="cat/1", variant=2)
    b, ops_b = _augment(src.copy(), (320, 240), seed=5, key="cat/1", variant=2)
    assert a.size == b.size
    assert a.tobytes() == b.tobytes()
    assert ops_a == ops_b


def test_augment_differs_across_variants_keys_and_seeds():
    src = _gradient(320, 240)
    views = [
        _augment(src, (320, 240), seed=seed, key=key, variant=variant)
        for seed, key, variant in [(0, "k", 0), (0, "k", 1), (0, "k", 2), (0, "k", 3), (1, "k", 0), (0, "j", 0)]
    ]
    assert len({img.tobytes() for img, _ in views}) == len(views)
    assert len({repr(ops) for _, ops in views}) == len(views)


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("shape", [(640, 480), (480, 640)])
@pytest.mark.parametrize("variant", range(6))
def test_augment_output_size_follows_the_mode(mode, shape, variant):
    img, ops = _augment(_gradient(*shape), shape, mode=mode, variant=variant)
    crop = ops[0]
    assert crop["op"] == "random_resized_crop"
    if mode == "pad":  # the op records the picture's size before it is padded to SxS
        assert max(crop["output"]) == S
    else:
        assert list(img.size) == crop["output"]
    if mode == "shorter":
        assert min(img.size) == S
    elif mode == "longer":
        assert max(img.size) == S
    elif mode in ("center-crop", "pad"):
        assert img.size == (S, S)
    else:  # none: the crop at its own size
        assert img.size == (max(1, round(crop["size"][0])), max(1, round(crop["size"][1])))
        assert img.width <= shape[0] and img.height <= shape[1]


@pytest.mark.parametrize("mode", RESIZE_MODES)
def test_augment_never_upscales_a_small_image(mode):
    for variant in range(6):
        img, _ = _augment(_gradient(40, 30), (40, 30), mode=mode, variant=variant)
        if mode == "pad":
            assert img.size == (S, S)
        else:
            assert img.width <= 40 and img.height <= 30


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("factor", [2, 4])
def test_augment_size_does_not_depend_on_pre_reduction(mode, factor):
    src = _gradient(640, 480)
    for variant in range(4):
        a, ops_a = _augment(src, (640, 480), mode=mode, variant=variant)
        b, ops_b = _augment(src.reduce(factor), (640, 480), mode=mode, variant=variant)
        assert a.size == b.size
        assert ops_a == ops_b  # parameters are drawn in original coordinates
        diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
        assert diff.mean() < 8


ROTATING = AugmentSpec(variants=8, rotate=45.0, jitter=0.0, scale=(0.2, 1.0), ratio=(0.5, 2.0))


@pytest.mark.parametrize("shape", [(400, 300), (300, 400), (256, 256), (1000, 150)])
@pytest.mark.parametrize("mode", ["shorter", "center-crop", "none"])
@pytest.mark.parametrize("factor", [1, 2])
def test_rotated_crop_has_no_black_corners(shape, mode, factor):
    src = _white(*shape)
    if factor > 1:
        src = src.reduce(factor)
    angles = []
    for variant in range(8):
        img, ops = _augment(src, shape, mode=mode, augment=ROTATING, variant=variant, key="white")
        angles.append(abs(ops[0]["angle"]))
        pixels = np.asarray(img)
        corners = pixels[[0, 0, -1, -1], [0, -1, 0, -1]]
        assert corners.min() >= 235, (variant, ops, corners)
        assert pixels.min() >= 200, (variant, ops)
    assert max(angles) > 10  # the test did rotate


@settings(max_examples=40, deadline=None)
@given(
    st.integers(20, 600),
    st.integers(20, 600),
    st.floats(0.0, 45.0),
    st.integers(0, 2**32),
)
def test_rotated_crop_stays_inside_the_image(width, height, rotate, seed):
    augment = AugmentSpec(variants=1, rotate=rotate, jitter=0.0, scale=(0.05, 1.0), ratio=(0.2, 5.0))
    img, ops = augment_image(_white(width, height), (width, height), ResizeSpec(size=16, mode="shorter"), augment,
                             variant_rng(seed, "x", 0))
    assert np.asarray(img).min() >= 200, ops


@pytest.mark.parametrize("mode", RESIZE_MODES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 100), (100, 1), (3, 7), (9, 2)])
def test_tiny_images_survive_every_mode(mode, shape):
    resize = ResizeSpec(size=8, mode=mode)
    img, _ = resize_image(_white(*shape), shape, resize)
    assert img.size == _expected_size(mode, *shape, 8, False)
    for variant in range(3):
        augment = AugmentSpec(variants=3, rotate=45.0)
        img, _ = augment_image(_white(*shape), shape, resize, augment, variant_rng(0, "t", variant))
        assert img.width >= 1 and img.height >= 1
        if mode == "pad":
            assert img.size == (8, 8)
        else:
            assert img.width <= shape[0] and img.height <= shape[1]


def test_ops_record_the_parameters():
    img, ops = _augment(_gradient(320, 240), (320, 240), augment=AugmentSpec(variants=1, flip=True, jitter=0.3))
    crop = ops[0]
    assert set(crop) == {"op", "center", "size", "angle", "output"}
    cx, cy = crop["center"]
    cw, ch = crop["size"]
    assert 0 < cw <= 320 and 0 < ch <= 240
    assert cw / 2 - 0.01 <= cx <= 320 - cw / 2 + 0.01
    assert ch / 2 - 0.01 <= cy <= 240 - ch / 2 + 0.01
    assert abs(crop["angle"]) <= 10.0
    assert crop["output"] == list(img.size)
    names = [op["op"] for op in ops]
    assert names[0] == "random_resized_crop"
    assert names[-1] == "colour_jitter"
    jitter = ops[-1]
    assert set(jitter) == {"op", "brightness", "contrast", "saturation"}
    assert all(0.7 <= jitter[k] <= 1.3 for k in ("brightness", "contrast", "saturation"))


def test_ops_are_json_serialisable():
    import json

    _, ops = _augment(_gradient(320, 240), (320, 240))
    assert json.loads(json.dumps(ops)) == ops


def test_flip_happens_in_some_variants_only_when_enabled():
    src = _gradient(320, 240)
    flipped = [
        any(op["op"] == "hflip" for op in _augment(src, (320, 240), variant=v)[1]) for v in range(40)
    ]
    assert 5 < sum(flipped) < 35
    never = AugmentSpec(variants=1, flip=False)
    assert not any(
        any(op["op"] == "hflip" for op in _augment(src, (320, 240), augment=never, variant=v)[1]) for v in range(20)
    )


def test_hflip_mirrors_the_picture():
    # No rotation, no jitter, full-image crop: the only change is the flip.
    plain = AugmentSpec(variants=1, rotate=0.0, jitter=0.0, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    src = _gradient(320, 240)
    for variant in range(10):
        img, ops = _augment(src, (320, 240), mode="none", augment=plain, variant=variant)
        assert img.size == (320, 240)
        pixels = np.asarray(img).astype(int)
        left_red, right_red = pixels[:, :10, 0].mean(), pixels[:, -10:, 0].mean()
        if any(op["op"] == "hflip" for op in ops):
            assert left_red > right_red + 100
        else:
            assert right_red > left_red + 100


def test_no_jitter_no_rotate_records_no_such_ops():
    plain = AugmentSpec(variants=1, rotate=0.0, jitter=0.0, flip=False)
    _, ops = _augment(_gradient(320, 240), (320, 240), augment=plain)
    assert [op["op"] for op in ops] == ["random_resized_crop"]
    assert ops[0]["angle"] == 0.0
