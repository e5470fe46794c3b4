"""`augment=[...]`: each op list comes to the loader settings of the recipe it names, or is refused with why."""

from __future__ import annotations

import pytest

from pipeline import ConfigError
from pipeline.augment.ops import (
    HSV,
    CutMix,
    Flip,
    IoUCrop,
    Letterbox,
    MixUp,
    Mosaic,
    RandomAffine,
    RandomResizedCrop,
    ScaleJitter,
    loader_settings,
)


def test_a_placement_with_a_flip_is_its_recipe() -> None:
    assert loader_settings([RandomResizedCrop(scale=(0.2, 1.0)), Flip()]) == {
        "recipe": "crop", "scale": (0.2, 1.0), "ratio": (3 / 4, 4 / 3), "flip": True}  # fmt: skip
    assert loader_settings([Letterbox()]) == {"recipe": "letterbox", "flip": False}
    assert loader_settings([ScaleJitter(0.5, 1.5), Flip()]) == {"recipe": "scale_jitter", "jitter": (0.5, 1.5), "flip": True}
    assert loader_settings([IoUCrop(), Flip()])["recipe"] == "iou_crop"


def test_ultralytics_family_is_the_yolo_recipe_and_a_missing_op_is_off() -> None:
    settings = loader_settings([Mosaic(), RandomAffine(degrees=10), Flip(), HSV(), MixUp(0.1), CutMix(0.2)])
    assert settings["recipe"] == "yolo"
    hyp = settings["hyp"]
    assert loader_settings([Mosaic(n=9)])["hyp"]["mosaic_n"] == 9 and hyp["mosaic_n"] == 4
    assert hyp["mosaic"] == 1.0 and hyp["degrees"] == 10 and hyp["translate"] == 0.1 and hyp["fliplr"] == 0.5
    assert (hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"]) == (0.015, 0.7, 0.4) and hyp["mixup"] == 0.1 and hyp["cutmix"] == 0.2
    plain = loader_settings([RandomAffine()])["hyp"]
    assert plain["mosaic"] == 0.0 and plain["fliplr"] == 0.0 and plain["hsv_v"] == 0.0 and plain["mixup"] == 0.0


@pytest.mark.parametrize(
    ("ops", "reason"),
    [
        ([], "at least one op"),
        (["Mosaic"], "not an op"),
        ([Letterbox(), RandomResizedCrop()], "one placement"),
        ([Letterbox(), HSV()], "one placement"),
        ([Letterbox(), Flip(vertical=0.5)], "left-right"),
        ([RandomAffine(), Mosaic()], "that order"),
        ([Mosaic(), Mosaic()], "at most once"),
    ],
)
def test_a_list_that_is_no_recipe_is_refused_with_the_reason(ops: list, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        loader_settings(ops)
