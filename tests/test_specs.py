"""Specs: validation names the flag, JSON round trips, parse_bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import ConfigError
from pipeline.specs import (
    DEFAULT_SHARD_BYTES,
    FORMATS,
    ORDERS,
    RESIZE_MODES,
    AugmentSpec,
    EncodeSpec,
    PrepareSpec,
    ResizeSpec,
    ShardSpec,
)
from pipeline.units import parse_bytes

# ---------------------------------------------------------------------------
# Validation: every bad value is a ConfigError whose message names the setting (the CLI names its option)


@pytest.mark.parametrize(
    ("spec_type", "kwargs", "setting"),
    [
        (ResizeSpec, {"size": 0}, "size"),
        (ResizeSpec, {"size": 7}, "size"),
        (ResizeSpec, {"size": 16385}, "size"),
        (ResizeSpec, {"size": 256.0}, "size"),
        (ResizeSpec, {"size": "256"}, "size"),
        (ResizeSpec, {"size": True}, "size"),
        (ResizeSpec, {"mode": "stretch"}, "mode"),
        (ResizeSpec, {"resample": "nearest"}, "resample"),
        (AugmentSpec, {"variants": -1}, "variants"),
        (AugmentSpec, {"variants": 1001}, "variants"),
        (AugmentSpec, {"variants": 2.0}, "variants"),
        (AugmentSpec, {"scale": (0.9, 0.5)}, "scale"),
        (AugmentSpec, {"scale": (0.0, 0.5)}, "scale"),
        (AugmentSpec, {"scale": (0.5, 1.5)}, "scale"),
        (AugmentSpec, {"scale": (0.5,)}, "scale"),
        (AugmentSpec, {"scale": (0.2, 0.5, 0.9)}, "scale"),
        (AugmentSpec, {"ratio": (2.0, 1.0)}, "ratio"),
        (AugmentSpec, {"ratio": (0.05, 1.0)}, "ratio"),
        (AugmentSpec, {"ratio": (1.0, 11.0)}, "ratio"),
        (AugmentSpec, {"jitter": -0.1}, "jitter"),
        (AugmentSpec, {"jitter": 0.95}, "jitter"),
        (AugmentSpec, {"jitter": "0.2"}, "jitter"),
        (AugmentSpec, {"rotate": -1.0}, "rotate"),
        (AugmentSpec, {"rotate": 46.0}, "rotate"),
        (EncodeSpec, {"format": "gif"}, "format"),
        (EncodeSpec, {"quality": 0}, "quality"),
        (EncodeSpec, {"quality": 101}, "quality"),
        (EncodeSpec, {"quality": 90.5}, "quality"),
        (ShardSpec, {"max_bytes": 1024}, "max_bytes"),
        (ShardSpec, {"max_bytes": "256MB"}, "max_bytes"),
        (ShardSpec, {"max_samples": 0}, "max_samples"),
        (ShardSpec, {"max_samples": -5}, "max_samples"),
        (ResizeSpec, {"upscale": "no"}, "upscale"),
        (ResizeSpec, {"upscale": 1}, "upscale"),
        (AugmentSpec, {"flip": "yes"}, "flip"),
        (AugmentSpec, {"jitter": float("nan")}, "jitter"),
        (AugmentSpec, {"rotate": float("inf")}, "rotate"),
        (AugmentSpec, {"scale": (float("nan"), 1.0)}, "scale"),
        (AugmentSpec, {"ratio": (0.5, float("inf"))}, "ratio"),
    ],
)
def test_bad_value_is_config_error_naming_the_setting(spec_type, kwargs, setting):
    # A Python caller reads the name it passed (`max_samples`), not a flag of the CLI (`--shard-samples`).
    with pytest.raises(ConfigError, match=rf"^{setting} ") as raised:
        spec_type(**kwargs)
    assert "--" not in str(raised.value)
    # The same through from_dict (a task message or a manifest's params).
    with pytest.raises(ConfigError, match=rf"^{setting} "):
        spec_type.from_dict({k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"train": "no"}, "train"),
        ({"channels_last": 1}, "channels_last"),
        ({"flip": "false"}, "flip"),
        ({"drop_last": "no"}, "drop_last"),
        ({"verify": 0}, "verify"),
        ({"mean": (float("nan"), 0.5, 0.5)}, "mean"),
        ({"std": (0.2, float("inf"), 0.2)}, "std"),
        ({"eval_fraction": float("nan")}, "eval_fraction"),
        ({"scale": (float("nan"), 1.0)}, "scale"),
    ],
)
def test_loader_spec_refuses_non_booleans_and_non_finite_numbers(kwargs, setting):
    from pipeline.specs import LoaderSpec

    with pytest.raises(ConfigError, match=rf"^{setting} "):
        LoaderSpec(batch_size=8, **kwargs)


def test_config_error_is_a_value_error():
    # Callers that only know ValueError still catch bad settings.
    with pytest.raises(ValueError):
        ResizeSpec(size=1)


def test_shard_spec_needs_a_bound():
    with pytest.raises(ConfigError, match="max_bytes.*max_samples"):
        ShardSpec(max_bytes=None, max_samples=None)
    assert ShardSpec(max_bytes=None, max_samples=10).max_samples == 10
    assert ShardSpec().max_bytes == DEFAULT_SHARD_BYTES


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"source": ""}, "source"),
        ({"source": "   "}, "source"),
        ({"out": ""}, "out"),
        ({"out": 5}, "out"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"max_pixels": 10}, "max_pixels"),
        ({"max_file_bytes": 0}, "max_file_bytes"),
        ({"background": (0, 0)}, "background"),
        ({"background": (0, 0, 256)}, "background"),
        ({"background": (0, 0, -1)}, "background"),
        ({"background": (0, 0, 1.0)}, "background"),
        ({"background": (True, 0, 0)}, "background"),
        ({"order": "size"}, "order"),
    ],
)
def test_prepare_spec_bad_value(kwargs, flag):
    values = {"source": "src", "out": "out", **kwargs}
    with pytest.raises(ConfigError, match=flag):
        PrepareSpec(**values)


@pytest.mark.parametrize("scale", [0.5, None, ("a", 1.0)])
def test_augment_scale_of_wrong_type_names_the_setting(scale):
    with pytest.raises(ConfigError, match="^scale"):
        AugmentSpec.from_dict({"scale": scale})
    with pytest.raises(ConfigError, match="^scale"):
        AugmentSpec(scale=scale)


def test_prepare_background_of_wrong_type_names_the_setting():
    with pytest.raises(ConfigError, match="background"):
        PrepareSpec.from_dict({"source": "s", "out": "o", "background": 5})
    with pytest.raises(ConfigError, match="background"):
        PrepareSpec(source="s", out="o", background=5)  # type: ignore[arg-type]


def test_specs_are_frozen():
    spec = ResizeSpec()
    with pytest.raises(AttributeError):
        spec.size = 5  # type: ignore[misc]


# ---------------------------------------------------------------------------
# to_dict / from_dict


def test_unknown_keys_rejected():
    with pytest.raises(ConfigError, match="unknown setting.*colour"):
        ResizeSpec.from_dict({"size": 64, "colour": "red"})
    with pytest.raises(ConfigError, match="unknown setting.*bogus"):
        PrepareSpec.from_dict({"source": "s", "out": "o", "bogus": 1})
    with pytest.raises(ConfigError, match="ResizeSpec.*unknown setting.*sise"):
        PrepareSpec.from_dict({"source": "s", "out": "o", "resize": {"sise": 64}})
    with pytest.raises(ConfigError, match="unknown setting.*varients"):
        PrepareSpec.from_dict({"source": "s", "out": "o", "augment": {"varients": 2}})


def test_from_dict_needs_an_object():
    with pytest.raises(ConfigError, match="JSON object"):
        ResizeSpec.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="JSON object"):
        PrepareSpec.from_dict("source")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="JSON object"):
        PrepareSpec.from_dict({"source": "s", "out": "o", "encode": None})


def test_prepare_spec_missing_required_is_config_error():
    with pytest.raises(ConfigError, match="PrepareSpec"):
        PrepareSpec.from_dict({"out": "o"})


def test_from_dict_uses_defaults_for_missing_keys():
    spec = PrepareSpec.from_dict({"source": "s", "out": "o", "resize": {"size": 64}})
    assert spec.resize == ResizeSpec(size=64)
    assert spec.augment == AugmentSpec()
    assert spec == PrepareSpec(source="s", out="o", resize=ResizeSpec(size=64))


def test_to_dict_is_plain_json():
    spec = PrepareSpec(source="s", out="o", augment=AugmentSpec(variants=2))
    data = spec.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["augment"]["scale"] == [0.35, 1.0]
    assert data["background"] == [255, 255, 255]
    assert isinstance(data["resize"], dict)


def test_output_identity_excludes_out_only():
    a = PrepareSpec(source="s", out="/x")
    b = PrepareSpec(source="s", out="/y")
    assert a.output_identity() == b.output_identity()
    assert "out" not in a.output_identity()
    assert a.output_identity() != PrepareSpec(source="s", out="/x", seed=1).output_identity()
    assert "order" not in a.output_identity()  # the default: a dataset prepared before orders existed is the same job
    assert PrepareSpec(source="s", out="/x", order="aspect").output_identity()["order"] == "aspect"


def _pair(low: float, high: float):
    return st.tuples(
        st.floats(low, high, allow_nan=False, allow_infinity=False),
        st.floats(low, high, allow_nan=False, allow_infinity=False),
    ).map(lambda p: tuple(sorted(p)))


resize_specs = st.builds(
    ResizeSpec,
    size=st.integers(8, 16384),
    mode=st.sampled_from(RESIZE_MODES),
    upscale=st.booleans(),
    resample=st.sampled_from(["lanczos", "bicubic", "bilinear"]),
)
augment_specs = st.builds(
    AugmentSpec,
    variants=st.integers(0, 1000),
    scale=_pair(0.01, 1.0),
    ratio=_pair(0.1, 10.0),
    flip=st.booleans(),
    jitter=st.floats(0.0, 0.9),
    rotate=st.floats(0.0, 45.0),
)
encode_specs = st.builds(EncodeSpec, format=st.sampled_from(FORMATS), quality=st.integers(1, 100))
shard_specs = st.one_of(
    st.builds(ShardSpec, max_bytes=st.integers(64 * 1024, 2**40), max_samples=st.none() | st.integers(1, 10**7)),
    st.builds(ShardSpec, max_bytes=st.none(), max_samples=st.integers(1, 10**7)),
)
text = st.text(min_size=1, max_size=30).filter(lambda s: s.strip())
prepare_specs = st.builds(
    PrepareSpec,
    source=text,
    out=text,
    resize=resize_specs,
    augment=augment_specs,
    encode=encode_specs,
    shards=shard_specs,
    seed=st.integers(0, 2**63 - 1),
    max_pixels=st.integers(64, 2**40),
    max_file_bytes=st.integers(1, 2**40),
    background=st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255)),
    order=st.sampled_from(ORDERS),
)


@settings(max_examples=150, deadline=None)
@given(prepare_specs)
def test_prepare_spec_round_trips_through_json(spec):
    data = json.loads(json.dumps(spec.to_dict()))
    again = PrepareSpec.from_dict(data)
    assert again == spec
    assert again.to_dict() == spec.to_dict()
    assert isinstance(again.augment.scale, tuple) and isinstance(again.background, tuple)


@settings(max_examples=60, deadline=None)
@given(st.one_of(resize_specs, augment_specs, encode_specs, shard_specs))
def test_nested_spec_round_trips_through_json(spec):
    data = json.loads(json.dumps(spec.to_dict()))
    assert type(spec).from_dict(data) == spec


def test_encode_extension():
    assert EncodeSpec(format="jpeg").extension == "jpg"
    assert EncodeSpec(format="npy").extension == "npy"


# ---------------------------------------------------------------------------
# parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MB", 256 * 10**6),
        ("256mb", 256 * 10**6),
        ("1GiB", 2**30),
        ("1gib", 2**30),
        ("10 MiB", 10 * 2**20),
        ("64k", 64_000),
        ("64KiB", 64 * 1024),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("2T", 2 * 10**12),
        ("2TiB", 2 * 2**40),
        ("100", 100),
        ("100B", 100),
        (" 3 kb ", 3000),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "GB", "-1", "1e3", "1.2.3MB", "12 parsecs", "5 MB extra", "MB5", True])
def test_parse_bytes_garbage_raises(text):
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["5i", "5ib", "5 iB"])
def test_parse_bytes_binary_marker_without_unit_raises(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["", "B", "k", "KB", "KiB", "M", "MB", "MiB", "G", "GiB"]))
def test_parse_bytes_whole_numbers(number, unit):
    factors = {"": 1, "B": 1, "k": 10**3, "KB": 10**3, "KiB": 2**10, "M": 10**6, "MB": 10**6, "MiB": 2**20}
    factors |= {"G": 10**9, "GiB": 2**30}
    assert parse_bytes(f"{number}{unit}") == number * factors[unit]
