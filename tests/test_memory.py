"""`estimate_memory` / `gpufeed estimate-memory`: the memory and speed arithmetic, checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeline
from pipeline.errors import ConfigError
from pipeline.measure.memory import (
    ThroughputModel,
    check_model_input,
    count_activations,
    estimate_memory,
    fit_step_times,
    largest_batch,
    load_model,
    model_state_bytes,
    parse_shape,
)


def small_cnn() -> nn.Module:
    """1,562 parameters: conv 3->8 (224), conv 8->16 (1,168), linear 16->10 (170)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def small_mlp() -> nn.Module:
    """325 parameters: 10*20 + 20 + 20*5 + 5."""
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


CNN_PARAMS, MLP_PARAMS = 1562, 325
# Hand count for a 3x32x32 input, elements per sample: conv1 8*32*32, relu 8*32*32 (not in place),
# maxpool 8*16*16, conv2 16*16*16 (its in-place ReLU writes the same memory), avgpool 16
# (flatten is a view of it), linear 10.
CNN_ACTIVATION_ELEMENTS = 8 * 32 * 32 * 2 + 8 * 16 * 16 + 16 * 16 * 16 + 16 + 10
CNN_FORWARD_FLOPS = 2 * (8 * 32 * 32 * 3 * 9) + 2 * (16 * 16 * 16 * 8 * 9) + 2 * 16 * 10


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Tiny models on a busy 2-core machine: OpenMP spinning only slows the timings down.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("optimizer", "multiplier", "state_share"),
    [("sgd", 2, 0), ("momentum", 3, 1), ("adam", 4, 2)],
)
@pytest.mark.parametrize(("factory", "params"), [(small_cnn, CNN_PARAMS), (small_mlp, MLP_PARAMS)])
def test_parameters_gradients_and_optimizer_state_are_exact(
    factory: object, params: int, optimizer: str, multiplier: int, state_share: int
) -> None:
    shape = (3, 32, 32) if params == CNN_PARAMS else (10,)
    estimate = estimate_memory(factory(), shape, optimizer=optimizer)  # type: ignore[operator]
    assert estimate.parameters == params
    assert estimate.parameter_bytes == 4 * params
    assert estimate.gradient_bytes == 4 * params
    assert estimate.optimizer_state_bytes == state_share * 4 * params
    assert estimate.parameter_bytes + estimate.gradient_bytes + estimate.optimizer_state_bytes == multiplier * 4 * params
    half = estimate_memory(factory(), shape, optimizer=optimizer, dtype="bfloat16")  # type: ignore[operator]
    assert half.parameter_bytes + half.gradient_bytes + half.optimizer_state_bytes == multiplier * 2 * params


def test_inference_counts_no_gradients_no_state_and_activations_once() -> None:
    training = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam")
    inference = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam", training=False)
    assert inference.gradient_bytes == inference.optimizer_state_bytes == 0
    assert inference.fixed_bytes == 4 * CNN_PARAMS
    assert inference.activation_factor == 1 and training.activation_factor == 2
    assert inference.per_sample_bytes == 4 * CNN_ACTIVATION_ELEMENTS + 4 * 3 * 32 * 32
    assert training.per_sample_bytes == 2 * 4 * CNN_ACTIVATION_ELEMENTS + 4 * 3 * 32 * 32
    assert inference.flops_per_sample_step == inference.flops_per_sample_forward
    assert training.flops_per_sample_step == 3 * training.flops_per_sample_forward


def test_activations_match_a_hand_count() -> None:
    assert count_activations(small_cnn(), (3, 32, 32), True, 4) == 4 * CNN_ACTIVATION_ELEMENTS
    assert count_activations(small_cnn(), (3, 32, 32), True, 2) == 2 * CNN_ACTIVATION_ELEMENTS
    # Linear 20 + ReLU 20 (new tensor) + Linear 5.
    assert count_activations(small_mlp(), (10,), True, 4) == 4 * (20 + 20 + 5)


def test_buffers_count_once() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    estimate = estimate_memory(model, (3, 8, 8), optimizer="adam")
    assert estimate.buffer_bytes == 4 * (4 + 4) + 8  # running mean and var (float), num_batches_tracked (int64)
    assert estimate.fixed_bytes == 4 * 4 * (3 * 4 + 4 + 4 + 4) + estimate.buffer_bytes


def test_flops_per_sample() -> None:
    assert estimate_memory(small_mlp(), (10,)).flops_per_sample_forward == 2 * (10 * 20 + 20 * 5)
    assert estimate_memory(small_mlp(), (10,)).flops_per_sample_step == 3 * 2 * (10 * 20 + 20 * 5)
    assert estimate_memory(small_cnn(), (3, 32, 32)).flops_per_sample_forward == CNN_FORWARD_FLOPS


def test_largest_batch_follows_the_arithmetic() -> None:
    estimate = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam")
    fixed, per_sample, margin = estimate.fixed_bytes, estimate.per_sample_bytes, 0.1
    for batch in (1, 7, 100, 5000):
        vram = int((fixed + batch * per_sample) / (1 - margin)) + 1
        limited = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam", vram=vram, safety_margin=margin)
        assert limited.max_batch_size == batch
        assert limited.memory_for_batch(batch) <= vram * (1 - margin) < limited.memory_for_batch(batch + 1)
    big = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB")
    inference = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", training=False)
    half = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", dtype="float16")
    # Activations dominate: inference needs about half per sample, float16 exactly half.
    assert inference.max_batch_size and big.max_batch_size
    assert inference.max_batch_size >= 1.7 * big.max_batch_size
    assert half.max_batch_size == pytest.approx(2 * big.max_batch_size, rel=0.01)
    assert largest_batch(1000, 0.1, 950, 10) == 0
    assert largest_batch(10_000, 0.0, 1000, 100) == 90
    assert largest_batch(10_000, 0.5, 1000, 100) == 40


def test_rows_mark_what_fits() -> None:
    estimate = estimate_memory(small_cnn(), (3, 32, 32), vram="64MiB")
    assert estimate.max_batch_size
    fits = {row.batch_size: row.fits for row in estimate.rows}
    assert fits[estimate.max_batch_size] is True
    assert all(value for batch, value in fits.items() if batch <= estimate.max_batch_size)
    assert estimate.rows[-1].batch_size == estimate.max_batch_size


def test_model_state_that_does_not_fit_says_so() -> None:
    estimate = estimate_memory(nn.Linear(1000, 1000), (1000,), vram="4MB")
    assert estimate.max_batch_size == 0
    assert any("does not fit" in note for note in estimate.notes)


def test_throughput_model_arithmetic() -> None:
    model = ThroughputModel(overhead_s=0.010, seconds_per_sample=0.001, source="given")
    assert model.images_per_s(10) == pytest.approx(500.0)
    assert model.peak_images_per_s == pytest.approx(1000.0)
    assert model.saturation_batch() == 90  # 90 % of peak: B = 0.9 * 10 ms / (0.1 * 1 ms)
    assert model.images_per_s(90) == pytest.approx(900.0)
    assert fit_step_times([(4, 0.014), (16, 0.026), (64, 0.074)]) == pytest.approx((0.010, 0.001))
    assert fit_step_times([(8, 0.016)]) == pytest.approx((0.0, 0.002))


def test_given_flops_give_images_per_s_and_the_loader_verdict() -> None:
    step_flops = 3 * CNN_FORWARD_FLOPS
    estimate = estimate_memory(
        small_cnn(), (3, 32, 32), vram="1GiB", device_flops=step_flops * 1000.0, loader_images_per_s=400.0
    )
    assert estimate.throughput is not None and estimate.throughput.source == "given"
    assert estimate.throughput.peak_images_per_s == pytest.approx(1000.0)
    assert estimate.required_images_per_s == pytest.approx(1000.0)
    assert estimate.loader_can_feed is False
    fed = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", device_flops=step_flops * 300.0, loader_images_per_s=400.0)
    assert fed.loader_can_feed is True
    assert estimate_memory(small_cnn(), (3, 32, 32)).loader_can_feed is None


def test_measured_on_synthetic_batches() -> None:
    model = small_mlp()
    estimate = estimate_memory(model, (10,), optimizer="momentum", measure=True, device="cpu", measure_seconds=0.2)
    throughput = estimate.throughput
    assert throughput is not None and throughput.source == "measured" and throughput.device == "cpu"
    assert [batch for batch, _ in throughput.points] == [4, 16]
    assert throughput.seconds_per_sample > 0 and estimate.device_flops and estimate.device_flops > 0
    assert all(row.images_per_s and row.images_per_s > 0 for row in estimate.rows)
    assert next(model.parameters()).device.type == "cpu"  # measured on a copy


def test_public_api_and_model_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pipeline.estimate_memory is estimate_memory
    (tmp_path / "gpufeed_test_models.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))\n\n"
        "def not_a_model():\n    return 42\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert estimate_memory("gpufeed_test_models:mlp", "10").parameters == MLP_PARAMS
    assert sum(p.numel() for p in load_model("gpufeed_test_models:mlp").parameters()) == MLP_PARAMS
    by_path = load_model(str(tmp_path / "gpufeed_test_models.py") + ":mlp")
    assert sum(p.numel() for p in by_path.parameters()) == MLP_PARAMS
    for spec, message in [
        ("gpufeed_test_models", "module:factory"),
        ("no_such_module_here:make", "cannot import"),
        ("gpufeed_test_models:missing", "no attribute"),
        ("gpufeed_test_models:not_a_model", "not a torch.nn.Module"),
        ("missing/file.py:mlp", "file not found"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_model(spec)
    assert parse_shape("3,224,224") == (3, 224, 224)
    for bad in ("3,x", "", "3,0"):
        with pytest.raises(ConfigError):
            parse_shape(bad)
    with pytest.raises(ConfigError):
        model_state_bytes(100, "lbfgs", True)
    with pytest.raises(ConfigError):
        estimate_memory(small_mlp(), (10,), dtype="int8")


def test_cli(tmp_path: Path) -> None:
    (tmp_path / "cli_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def cnn():
                return nn.Sequential(
                    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                    nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
                )
            """
        )
    )
    base = [
        sys.executable, "-m", "pipeline", "estimate-memory", "--model", "cli_models:cnn", "--input", "3,32,32",
        "--optimizer", "momentum", "--vram", "64MiB", "--device-flops", "1G", "--loader-images-per-s", "50",
    ]
    result = subprocess.run([*base, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["parameters"] == CNN_PARAMS
    assert data["parameter_bytes"] + data["gradient_bytes"] + data["optimizer_state_bytes"] == 3 * 4 * CNN_PARAMS
    assert data["activation_bytes_per_sample"] == 4 * CNN_ACTIVATION_ELEMENTS
    assert data["throughput"]["source"] == "given"
    assert data["loader_can_feed"] is (50 >= 1e9 / (3 * CNN_FORWARD_FLOPS))
    text = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 0, text.stderr
    assert "largest batch in 64 MiB" in text.stdout and "optimizer state" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "estimate-memory", "--model", "nope:x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert bad.returncode == 1 and "cannot import" in bad.stderr


MISTAKES = """
from torch import nn

def needs_width(width):
    return nn.Linear(width, 2)

def broken():
    raise RuntimeError("weights file missing")

def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--model", "mistakes.py:needs_width"],
            "--model mistakes.py:needs_width needs arguments (width); it is called without any: give a function that "
            "takes none",
            id="factory-needs-arguments",
        ),
        pytest.param(
            ["--model", "mistakes.py:broken"],
            "--model mistakes.py:broken failed when called: RuntimeError: weights file missing",
            id="factory-raises",
        ),
        pytest.param(
            ["--model", "mistakes.py:cnn", "--input", "224,224,3"],
            "mistakes.py:cnn cannot take --input 224,224,3 (one sample's shape): RuntimeError: ",
            id="input-channels-last",
        ),
    ],
)
def test_a_model_that_cannot_be_built_or_run_is_one_line_that_says_what_to_do(
    args: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    command = [sys.executable, "-m", "pipeline", "estimate-memory", *args, "--device-flops", "1T"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpufeed: error: {message}"), result.stderr
    if "--input" in args:
        assert lines[0].endswith("--input is channels first: did you mean 3,224,224?")
    as_json = subprocess.run([*command, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert as_json.returncode == 1 and as_json.stderr == ""
    assert json.loads(as_json.stdout)["error"].startswith(message)


def test_check_model_input_runs_one_sample_and_leaves_the_mode_alone() -> None:
    model = small_cnn().train()
    check_model_input(model, (3, 32, 32))
    assert model.training
    with pytest.raises(ConfigError, match=r"cannot take --input 32,32,3 .* did you mean 3,32,32\?"):
        check_model_input(model, (32, 32, 3))
    assert model.training


@pytest.mark.cuda
def test_estimate_matches_cuda_peak_memory() -> None:
    """The seed arithmetic against the CUDA caching allocator's peak, for one training step.

    An MLP trained with SGD + momentum: parameters, gradients and momentum are
    exact; the activations (x2 rule) are a modest share, and cuBLAS's
    workspace stays a few percent of ~350 MB.
    """
    device = torch.device("cuda")
    shape, batch = (3, 32, 32), 128

    def model() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))

    estimate = estimate_memory(model(), shape, optimizer="momentum")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    net = model().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn((batch, *shape), device=device)
    for step in range(2):  # the first step creates the momentum buffers
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        net(x).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    assert estimate.memory_for_batch(batch) == pytest.approx(peak, rel=0.2)
