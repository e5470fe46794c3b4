"""`estimate_memory` / `gpufeed estimate-memory`: the traced step against the measured one, and the rule of thumb.

The truth is `memory_truth.measure_step`: live tensor bytes over a real
training step on the CPU, itself checked against hand counts and against the
CPU allocator's own record.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from memory_truth import (
    BATCHES,
    MODELS,
    OPTIMIZERS,
    PRECISIONS,
    SHAPE,
    LiveBytes,
    allocator_peak,
    conv_net,
    measure_step,
    mlp,
    transformer,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipeline
from pipeline.errors import ConfigError
from pipeline.measure.memory.device import CachingAllocator
from pipeline.measure.memory.estimate import (
    MemoryEstimate,
    ThroughputModel,
    check_model_input,
    count_activations,
    estimate_memory,
    fit_step_times,
    largest_batch,
    load_loss,
    load_model,
    model_state_bytes,
    parse_shape,
)
from pipeline.measure.memory.trace import NotAffineError, StepModel, StepTrace

MiB = 1 << 20


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
CNN_TENSORS = 6  # weight and bias of each layer: Adam keeps one float32 step counter per tensor
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


def error(estimate: int, measured: int) -> float:
    return estimate / measured - 1.0


# ---------------------------------------------------------------------------
# The truth itself


def test_the_counter_counts_a_storage_once_and_lets_it_go_when_its_last_reference_does() -> None:
    counter = LiveBytes()
    with counter:
        a = torch.empty(1000)  # 4,000 bytes
        view = a.view(10, 100)[2:]  # a view: nothing new
        b = a * 2  # 4,000 more
        b.relu_()  # in place: nothing new
        assert counter.live == 8000
        del b
        assert counter.live == 4000
        del a
        assert counter.live == 4000  # the view still holds the storage
        del view
        assert counter.live == 0
        c = torch.empty(0)
        c.resize_(500)  # grown in place: 2,000 bytes
        assert counter.live == 2000
    assert counter.peak == 8000


@pytest.mark.parametrize("name", ["mlp", "transformer", "conv"])
def test_the_counter_agrees_with_the_cpu_allocator(name: str) -> None:
    """Where kernels allocate no scratch of their own (MLP, transformer) the two agree within 0.01 %.

    What is left is the allocator's 8-byte wrapped scalars. The CPU's
    convolutions allocate scratch (im2col columns) inside the kernel, where no
    tensor shows it: there the allocator sees more (+13 % here), which is the
    CPU's implementation of a convolution, not the step's tensors.
    """
    counted = measure_step(MODELS[name](), SHAPE, 16, optimizer="adam")
    recorded = allocator_peak(MODELS[name](), SHAPE, 16, optimizer="adam")
    if name == "conv":
        assert counted < recorded < 1.2 * counted
    else:
        assert counted == pytest.approx(recorded, rel=1e-4)


# ---------------------------------------------------------------------------
# The estimate against the truth: the test matrix


@pytest.fixture(scope="module")
def estimates() -> dict[tuple[str, str, str | None], MemoryEstimate]:
    torch.set_num_threads(1)
    return {
        (name, optimizer, precision): estimate_memory(
            make(), SHAPE, optimizer=optimizer, autocast=precision, for_device="cpu"
        )
        for name, make in MODELS.items()
        for optimizer in OPTIMIZERS
        for precision in PRECISIONS
    }


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("precision", PRECISIONS, ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_estimate_is_within_ten_percent_of_the_measured_peak(
    estimates: dict[tuple[str, str, str | None], MemoryEstimate],
    name: str, optimizer: str, precision: str | None, batch: int,
) -> None:
    estimate = estimates[(name, optimizer, precision)]
    measured = measure_step(MODELS[name](), SHAPE, batch, optimizer=optimizer, autocast=precision)
    assert estimate.affine
    assert abs(error(estimate.memory_for_batch(batch), measured)) <= 0.10, (estimate.memory_for_batch(batch), measured)


class CheckpointedMLP(nn.Module):
    """The middle of the MLP under activation checkpointing: its activations are recomputed in backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.first = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU())
        self.middle = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.last = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint(self.middle, self.first(x), use_reentrant=self.reentrant)
        return self.last(hidden)


class TiedMLP(nn.Module):
    """Two layers sharing one weight: a parameter, its gradient and its state count once."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3 * 32 * 32, 1024)
        self.square = nn.Linear(1024, 1024, bias=False)
        self.again = nn.Linear(1024, 1024, bias=False)
        self.again.weight = self.square.weight
        self.head = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.square(torch.relu(self.first(x.flatten(1)))))
        return self.head(self.again(hidden))


def squared_output(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """A loss of one's own: no labels, the mean square of the output."""
    return (output.float() ** 2).mean()


@pytest.mark.parametrize(
    ("case", "make", "options"),
    [
        ("adamw", mlp, {"optimizer": "adamw"}),
        ("adam-foreach", transformer, {"optimizer": "adam", "foreach": True}),
        ("adamw-foreach", mlp, {"optimizer": "adamw", "foreach": True}),
        ("momentum-foreach", conv_net, {"optimizer": "momentum", "foreach": True}),
        ("fp16-autocast", transformer, {"optimizer": "adam", "autocast": "float16"}),
        ("channels-last", conv_net, {"optimizer": "momentum", "channels_last": True}),
        ("checkpoint", lambda: CheckpointedMLP(False), {"optimizer": "sgd"}),
        ("checkpoint-reentrant", lambda: CheckpointedMLP(True), {"optimizer": "sgd"}),
        ("inference", conv_net, {"training": False}),
        ("inference-bf16", transformer, {"training": False, "autocast": "bfloat16"}),
        ("kept-gradients", mlp, {"optimizer": "momentum", "set_to_none": False}),
        ("own-loss", conv_net, {"optimizer": "sgd", "loss": squared_output}),
        ("tied-weights", TiedMLP, {"optimizer": "adam"}),
    ],
)
def test_every_covered_kind_of_step_is_within_ten_percent(case: str, make: object, options: dict[str, object]) -> None:
    estimate = estimate_memory(make(), SHAPE, for_device="cpu", **options)  # type: ignore[operator, arg-type]
    for batch in BATCHES:
        measured = measure_step(make(), SHAPE, batch, **options)  # type: ignore[operator, arg-type]
        assert abs(error(estimate.memory_for_batch(batch), measured)) <= 0.10, (case, batch)


def test_checkpointing_and_foreach_change_the_memory_the_way_they_should() -> None:
    plain = estimate_memory(mlp(), SHAPE, optimizer="adam", batch_size=16, for_device="cpu")
    foreach = estimate_memory(mlp(), SHAPE, optimizer="adam", foreach=True, batch_size=16, for_device="cpu")
    assert foreach.peak_phase == plain.peak_phase == "optimizer step"
    # foreach Adam: one square root of all second moments at once, a copy of all parameters;
    # per parameter: a square root and its quotient of the largest one (3072 x 1024) side by side.
    largest = 4 * 3072 * 1024
    assert foreach.breakdown["temporaries"] == pytest.approx(foreach.parameter_bytes, rel=0.01)
    assert plain.breakdown["temporaries"] == pytest.approx(2 * largest, rel=0.01)
    whole = nn.Sequential(nn.Flatten(), nn.Linear(3072, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    kept = estimate_memory(whole, SHAPE, optimizer="sgd", for_device="cpu")
    recomputed = estimate_memory(CheckpointedMLP(False), SHAPE, optimizer="sgd", for_device="cpu")
    # Backward keeps each ReLU's output (the next Linear's input too); checkpointing the middle keeps its
    # input and output and drops the one ReLU output inside it, 512 floats a sample.
    assert kept.kept_activation_bytes_per_sample == 4 * (3 * 512 + 10 + 10)  # + the logits and their log-softmax
    assert recomputed.kept_activation_bytes_per_sample == kept.kept_activation_bytes_per_sample - 4 * 512


class PairwiseSimilarity(nn.Module):
    """A batch-by-batch similarity matrix, as contrastive losses build: memory grows as B²."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)
        return (z @ z.T).repeat(1, 64)  # B x 64·B "logits"


def test_memory_that_is_not_affine_in_the_batch_is_traced_batch_by_batch_and_said_so() -> None:
    estimate = estimate_memory(PairwiseSimilarity(), SHAPE, optimizer="sgd", for_device="cpu", vram="64MiB")
    assert not estimate.affine
    assert any("not affine" in note for note in estimate.notes)
    for batch in (5, 40):
        measured = measure_step(PairwiseSimilarity(), SHAPE, batch, optimizer="sgd")
        assert abs(error(estimate.memory_for_batch(batch), measured)) <= 0.10
    top = estimate.max_batch_size
    assert top and estimate.memory_for_batch(top) <= 0.9 * 64 * MiB < estimate.memory_for_batch(top + 1)


def test_the_affine_fit_is_checked_on_a_third_trace() -> None:
    def trace(batch: int, sizes: tuple[int, ...]) -> StepTrace:
        return StepTrace(batch, sizes, ("temporaries",) * 2, (0, 1, ~1, ~0), 0, (("forward", 0),))

    model = StepModel.fit([trace(2, (100, 16)), trace(4, (100, 32)), trace(7, (100, 56))])
    assert model.peak(10) == 100 + 80 and model.largest_batch(180) == 10 and model.largest_batch(179) == 9
    with pytest.raises(NotAffineError, match="at batch 7"):
        StepModel.fit([trace(2, (100, 16)), trace(4, (100, 32)), trace(7, (100, 99))])
    with pytest.raises(NotAffineError, match="allocates differently"):
        StepModel.fit([trace(2, (100, 16)), StepTrace(4, (100, 32), ("temporaries",) * 2, (0, ~0, 1, ~1), 0, ())])


# ---------------------------------------------------------------------------
# The model state, the rule of thumb, the largest batch


@pytest.mark.parametrize(
    ("optimizer", "multiplier", "state_share", "counters"),
    [("sgd", 2, 0, 0), ("momentum", 3, 1, 0), ("adam", 4, 2, 1), ("adamw", 4, 2, 1)],
)
@pytest.mark.parametrize(("factory", "params"), [(small_cnn, CNN_PARAMS), (small_mlp, MLP_PARAMS)])
def test_parameters_gradients_and_optimizer_state_are_traced_exactly(
    factory: object, params: int, optimizer: str, multiplier: int, state_share: int, counters: int
) -> None:
    """The rule's ×2/×3/×4 holds for the traced state, plus Adam's float32 step counter per tensor.

    (The seed asserted state == (multiplier − 2) × parameters; the trace shows
    the step counters too, 4 bytes per parameter tensor.)
    """
    shape = (3, 32, 32) if params == CNN_PARAMS else (10,)
    tensors = CNN_TENSORS if params == CNN_PARAMS else 4
    estimate = estimate_memory(factory(), shape, optimizer=optimizer, for_device="cpu")  # type: ignore[operator]
    assert estimate.parameters == params
    assert estimate.parameter_bytes == estimate.gradient_bytes == 4 * params
    assert estimate.optimizer_state_bytes == state_share * 4 * params + counters * 4 * tensors
    assert estimate.rule.fixed_bytes == multiplier * 4 * params
    half = estimate_memory(factory(), shape, optimizer=optimizer, dtype="bfloat16", for_device="cpu")  # type: ignore[operator]
    assert half.parameter_bytes == half.gradient_bytes == 2 * params
    assert half.optimizer_state_bytes == state_share * 2 * params + counters * 4 * tensors
    assert model_state_bytes(4 * params, optimizer, True) == (4 * params, state_share * 4 * params)


def test_inference_has_no_gradients_no_state_and_the_rule_counts_activations_once() -> None:
    training = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam", for_device="cpu")
    inference = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam", training=False, for_device="cpu")
    assert inference.gradient_bytes == inference.optimizer_state_bytes == 0
    assert inference.rule.fixed_bytes == 4 * CNN_PARAMS
    assert inference.activation_factor == 1 and training.activation_factor == 2
    assert inference.rule.per_sample_bytes == 4 * CNN_ACTIVATION_ELEMENTS + 4 * 3 * 32 * 32
    assert training.rule.per_sample_bytes == 2 * 4 * CNN_ACTIVATION_ELEMENTS + 4 * 3 * 32 * 32
    assert inference.flops_per_sample_step == inference.flops_per_sample_forward
    assert training.flops_per_sample_step == 3 * training.flops_per_sample_forward
    # Inference frees each activation once the next layer has read it: far less than the rule's ×1.
    assert inference.per_sample_bytes < inference.rule.per_sample_bytes
    assert inference.phase_peaks.keys() == {"forward"}


def test_activations_match_a_hand_count() -> None:
    assert count_activations(small_cnn(), (3, 32, 32), True, 4) == 4 * CNN_ACTIVATION_ELEMENTS
    assert count_activations(small_cnn(), (3, 32, 32), True, 2) == 2 * CNN_ACTIVATION_ELEMENTS
    # Linear 20 + ReLU 20 (new tensor) + Linear 5.
    assert count_activations(small_mlp(), (10,), True, 4) == 4 * (20 + 20 + 5)


def test_buffers_count_once() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    estimate = estimate_memory(model, (3, 8, 8), optimizer="adam", for_device="cpu")
    assert estimate.buffer_bytes == 4 * (4 + 4) + 8  # running mean and var (float), num_batches_tracked (int64)
    assert estimate.rule.fixed_bytes == 4 * 4 * (3 * 4 + 4 + 4 + 4) + estimate.buffer_bytes


def test_flops_per_sample() -> None:
    assert estimate_memory(small_mlp(), (10,)).flops_per_sample_forward == 2 * (10 * 20 + 20 * 5)
    assert estimate_memory(small_mlp(), (10,)).flops_per_sample_step == 3 * 2 * (10 * 20 + 20 * 5)
    assert estimate_memory(small_cnn(), (3, 32, 32)).flops_per_sample_forward == CNN_FORWARD_FLOPS


def test_largest_batch_is_where_the_traced_peak_meets_the_limit() -> None:
    estimate = estimate_memory(small_cnn(), (3, 32, 32), optimizer="adam", for_device="cpu")
    margin = 0.1
    for batch in (1, 7, 100, 5000):
        vram = int(estimate.memory_for_batch(batch) / (1 - margin)) + 1
        limited = estimate_memory(
            small_cnn(), (3, 32, 32), optimizer="adam", vram=vram, safety_margin=margin, for_device="cpu"
        )
        assert limited.max_batch_size == batch
        assert limited.memory_for_batch(batch) <= vram * (1 - margin) < limited.memory_for_batch(batch + 1)
    big = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", for_device="cpu")
    inference = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", training=False, for_device="cpu")
    half = estimate_memory(small_cnn(), (3, 32, 32), vram="1GiB", dtype="float16", for_device="cpu")
    assert inference.max_batch_size and big.max_batch_size and half.max_batch_size
    # The seed's ×1 against ×2 said 1.7×; traced, it is the ratio of what each adds per sample.
    assert inference.max_batch_size > big.max_batch_size
    ratio = big.per_sample_bytes / inference.per_sample_bytes
    assert inference.max_batch_size == pytest.approx(ratio * big.max_batch_size, rel=0.01)
    # float16 halves every float, not max-pooling's int64 indices (8 x 16 x 16 a sample) nor the int64 labels
    # (the seed, counting everything at 2 bytes, said exactly half).
    assert half.per_sample_bytes == big.per_sample_bytes / 2 + 8 * 16 * 16 * 8 / 2 + 8 / 2
    ratio = big.per_sample_bytes / half.per_sample_bytes
    assert half.max_batch_size == pytest.approx(ratio * big.max_batch_size, rel=0.01)
    # Near the largest batch the peak is fixed + B × per-sample, the formula the batch comes from.
    top = big.max_batch_size
    assert big.fixed_bytes + top * big.per_sample_bytes == big.memory_for_batch(top)
    assert largest_batch(1000, 0.1, 950, 10) == 0
    assert largest_batch(10_000, 0.0, 1000, 100) == 90
    assert largest_batch(10_000, 0.5, 1000, 100) == 40


def test_rows_mark_what_fits() -> None:
    estimate = estimate_memory(small_cnn(), (3, 32, 32), vram="64MiB", for_device="cpu")
    assert estimate.max_batch_size
    fits = {row.batch_size: row.fits for row in estimate.rows}
    assert fits[estimate.max_batch_size] is True
    assert all(value for batch, value in fits.items() if batch <= estimate.max_batch_size)
    assert estimate.rows[-1].batch_size == estimate.max_batch_size
    assert all(row.rule_memory_bytes == estimate.rule.memory_for_batch(row.batch_size) for row in estimate.rows)


def test_model_state_that_does_not_fit_says_so() -> None:
    estimate = estimate_memory(nn.Linear(1000, 1000), (1000,), vram="4MB", for_device="cpu")
    assert estimate.max_batch_size == 0
    assert any("does not fit" in note for note in estimate.notes)


def test_the_rule_is_shown_beside_the_trace_with_its_error() -> None:
    """The MLP with Adam: the rule misses the optimizer step's temporaries and under-estimates."""
    estimate = estimate_memory(mlp(), SHAPE, optimizer="adam", batch_size=16, for_device="cpu")
    assert estimate.peak_batch == 16 and estimate.peak_phase == "optimizer step"
    assert estimate.breakdown["temporaries"] > 0 and estimate.rule.breakdown(16)["temporaries"] == 0
    assert sum(estimate.breakdown.values()) == estimate.memory_for_batch(16)
    measured = measure_step(mlp(), SHAPE, 16, optimizer="adam")
    assert estimate.rule_error == pytest.approx(estimate.rule.memory_for_batch(16) / measured - 1, abs=0.01)
    assert estimate.rule_error < -0.15
    conv = estimate_memory(conv_net(), SHAPE, optimizer="adam", batch_size=16, for_device="cpu")
    assert conv.peak_phase == "backward" and conv.rule_error > 0.15  # ×2 activations: too many
    assert conv.activation_multiple is not None and conv.activation_multiple < 1.9


# ---------------------------------------------------------------------------
# CUDA's allocator and context


def test_caching_allocator_rounds_blocks_and_keeps_segments() -> None:
    allocator = CachingAllocator()
    small = allocator.malloc(1000)  # a 1,024-byte block in a new 2 MiB segment
    assert allocator.allocated == 1024 and allocator.reserved == 2 * MiB
    again = allocator.malloc(1)
    assert allocator.allocated == 1024 + 512 and allocator.reserved == 2 * MiB  # the same segment
    allocator.free(small)
    allocator.free(again)
    assert allocator.allocated == 0 and allocator.reserved == 2 * MiB  # cached, not given back
    medium = allocator.malloc(3 * MiB)  # from a 20 MiB segment, split
    assert allocator.allocated == 3 * MiB and allocator.reserved == 22 * MiB
    rest = allocator.malloc(16 * MiB + 512 * 1024)  # the rest of that segment: 0.5 MiB left, not split
    assert allocator.reserved == 22 * MiB and allocator.allocated == 20 * MiB
    allocator.free(medium)
    allocator.free(rest)
    whole = allocator.malloc(20 * MiB)  # the two merged again: one 20 MiB block
    assert allocator.reserved == 22 * MiB and allocator.allocated == 20 * MiB
    big = allocator.malloc(11 * MiB + 1)  # its own segment, rounded up to 2 MiB
    assert allocator.reserved == 22 * MiB + 12 * MiB
    assert allocator.allocated == 20 * MiB + 12 * MiB  # 1 MiB left is not split off
    allocator.free(whole)
    allocator.free(big)
    assert allocator.malloc(0) is None and allocator.allocated == 0


def test_on_cuda_the_allocator_and_the_context_are_added() -> None:
    cpu = estimate_memory(transformer(), SHAPE, optimizer="adam", foreach=True, for_device="cpu")
    cuda = estimate_memory(transformer(), SHAPE, optimizer="adam", for_device="cuda", cuda_context="300MiB")
    assert cuda.foreach  # CUDA's default
    for batch in (4, 100):
        assert cuda.allocated_for_batch(batch) >= cpu.memory_for_batch(batch)
        assert cuda.reserved_for_batch(batch) >= cuda.allocated_for_batch(batch)
        assert cuda.memory_for_batch(batch) == 300 * MiB + cuda.reserved_for_batch(batch)
    assert cuda.cuda_context_source == "given" and cuda.cuda_context_bytes == 300 * MiB
    assumed = estimate_memory(small_mlp(), (10,), vram="16GiB")
    if not torch.cuda.is_available():
        assert assumed.memory_device == "cuda" and assumed.cuda_context_source == "assumed"
        assert any("CPU's kernels" in note for note in assumed.notes)


def test_where_a_smaller_batch_reserves_more_on_cuda_the_report_says_why() -> None:
    # The README's small CNN: at batch 1 its 784 KiB activations take 2 MiB small-pool segments of their own,
    # at batch 2 they share the large pool's 20 MiB segment: CUDA reserves more for batch 1 than for batch 2.
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 1000),
    )  # fmt: skip
    cuda = estimate_memory(model, (3, 224, 224), optimizer="adam", vram="16GiB", cuda_context="0", measure=False)
    memory = {row.batch_size: row.memory_bytes for row in cuda.rows}
    assert memory[1] > memory[2] < memory[4]
    assert cuda.memory.peak(1) < cuda.memory.peak(2)  # the tensor bytes grow with the batch
    assert cuda.memory.allocated(1) < cuda.memory.allocated(2)
    dips = [note for note in cuda.notes if note.startswith("batch 1 needs more device memory than batch 2")]
    assert len(dips) == 1 and "2 MiB segments" in dips[0] and "20 MiB segment" in dips[0]
    cpu = estimate_memory(model, (3, 224, 224), optimizer="adam", for_device="cpu", measure=False)
    sizes = [row.memory_bytes for row in cpu.rows]
    assert sizes == sorted(sizes) and not any("needs more device memory" in note for note in cpu.notes)


# ---------------------------------------------------------------------------
# Speed


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


# ---------------------------------------------------------------------------
# Models, losses and the command line


def test_a_meta_device_model_traces_like_the_real_one_and_is_not_timed(tmp_path: Path) -> None:
    (tmp_path / "gpufeed_meta_models.py").write_text(
        "from torch import nn\n\ndef mlp():\n    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 1024), nn.ReLU(), nn.Linear(1024, 10))\n"
    )
    meta = load_model(str(tmp_path / "gpufeed_meta_models.py") + ":mlp", meta=True)
    real = load_model(str(tmp_path / "gpufeed_meta_models.py") + ":mlp")
    assert next(meta.parameters()).is_meta
    traced = [estimate_memory(m, SHAPE, for_device="cpu").memory_for_batch(32) for m in (meta, real)]
    assert traced[0] == traced[1]
    assert next(meta.parameters()).is_meta  # given back as it came
    with pytest.raises(ConfigError, match="meta device"):
        estimate_memory(meta, SHAPE, measure=True, device="cpu")


def test_public_api_model_and_loss_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pipeline.estimate_memory is estimate_memory
    (tmp_path / "gpufeed_test_models.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))\n\n"
        "def not_a_model():\n    return 42\n\ndef vector():\n    return torch.nn.Sequential(torch.nn.Linear(10, 1), torch.nn.Flatten(0))\n\n"
        "def squares(output, inputs):\n    return (output ** 2).mean()\n\nNOT_CALLABLE = 3\n"
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
    assert load_loss("gpufeed_test_models:squares").__name__ == "squares"
    with pytest.raises(ConfigError, match="not a function"):
        load_loss("gpufeed_test_models:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="loss=module:fn"):  # a 1-D output has no classes
        estimate_memory("gpufeed_test_models:vector", "10")
    with_loss = estimate_memory("gpufeed_test_models:vector", "10", loss="gpufeed_test_models:squares")
    assert with_loss.loss == "gpufeed_test_models:squares"
    assert parse_shape("3,224,224") == (3, 224, 224)
    for bad in ("3,x", "", "3,0"):
        with pytest.raises(ConfigError):
            parse_shape(bad)
    with pytest.raises(ConfigError):
        model_state_bytes(100, "lbfgs", True)
    for options in ({"dtype": "int8"}, {"optimizer": "lbfgs"}, {"autocast": "int8"}, {"for_device": "tpu"}):
        with pytest.raises(ConfigError):
            estimate_memory(small_mlp(), (10,), **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot take input_shape="):  # the input does not fit the model
        estimate_memory(small_mlp(), (11,))


CLI_MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def cnn():
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )

    def squares(output, inputs):
        return (output ** 2).mean()
    """
)


def test_cli(tmp_path: Path) -> None:
    (tmp_path / "cli_models.py").write_text(CLI_MODELS)
    base = [
        sys.executable, "-m", "pipeline", "estimate-memory", "--model", "cli_models:cnn", "--input", "3,32,32",
        "--optimizer", "momentum", "--vram", "64MiB", "--for", "cpu", "--device-flops", "1G",
        "--loader-images-per-s", "50",
    ]
    result = subprocess.run([*base, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["parameters"] == CNN_PARAMS
    assert data["parameter_bytes"] + data["gradient_bytes"] + data["optimizer_state_bytes"] == 3 * 4 * CNN_PARAMS
    assert data["activation_bytes_per_sample"] == 4 * CNN_ACTIVATION_ELEMENTS
    assert data["throughput"]["source"] == "given"
    assert data["loader_can_feed"] is (50 >= 1e9 / (3 * CNN_FORWARD_FLOPS))
    assert data["affine"] is True and data["memory_device"] == "cpu"
    assert data["memory_bytes"] == sum(data["breakdown"].values())
    assert set(data["rule"]["breakdown"]) == set(data["breakdown"])
    text = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "largest batch in 64 MiB" in out and "optimizer state" in out
    assert "rule of thumb" in out and "temporaries" in out and "the ×2 rule says ×2" in out
    cuda = subprocess.run(
        [*base[:-8], "--autocast", "bf16", "--cuda-context", "16MiB", "--loss", "cli_models:squares",
         "--channels-last", "--no-foreach", "--zero-grad", "zeros", "--for", "cuda"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert cuda.returncode == 0, cuda.stderr
    assert "CUDA context 16 MiB (given)" in cuda.stdout and "allocator" in cuda.stdout
    assert "bfloat16 autocast" in cuda.stdout and "zero_grad(set_to_none=False)" in cuda.stdout
    for args, message in [
        (["--model", "nope:x"], "cannot import"),
        (["--model", "cli_models:cnn", "--loss", "cli_models:nothing"], "no attribute"),
        (["--model", "cli_models:cnn", "--input", "5"], "cannot take --input 5"),
    ]:
        bad = subprocess.run(
            [sys.executable, "-m", "pipeline", "estimate-memory", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        )
        assert bad.returncode == 1 and message in bad.stderr and "Traceback" not in bad.stderr


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
    with pytest.raises(ConfigError, match=r"cannot take input_shape=32,32,3 .* input_shape is channels first: did you mean 3,32,32\?"):
        check_model_input(model, (32, 32, 3))
    assert model.training


@pytest.mark.cuda
@pytest.mark.parametrize("precision", [None, "bfloat16"], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(MODELS))
def test_estimate_matches_the_cuda_allocator(name: str, precision: str | None) -> None:
    """The traced step against ``max_memory_allocated`` / ``max_memory_reserved`` of the same step on the GPU."""
    from memory_truth import cuda_step_peaks

    batch = 256  # tensors well above cuDNN's workspaces, which the trace does not see
    estimate = estimate_memory(MODELS[name](), SHAPE, optimizer="adam", autocast=precision, for_device="cuda")
    allocated, reserved = cuda_step_peaks(MODELS[name](), SHAPE, batch, optimizer="adam", autocast=precision)
    assert abs(error(estimate.allocated_for_batch(batch), allocated)) <= 0.10
    assert abs(error(estimate.reserved_for_batch(batch), reserved)) <= 0.10


def test_the_memory_chart_has_readable_ticks_and_marks_the_limit(tmp_path: Path) -> None:
    from pipeline.measure import plots

    estimate = estimate_memory(
        conv_net(), SHAPE, optimizer="adam", vram="8GiB", device_flops=20e12, loader_images_per_s=30000.0
    )
    assert estimate.max_batch_size and estimate.max_batch_size & (estimate.max_batch_size - 1)  # not a power of two
    figure = plots.memory_figure(estimate)
    axis = figure.axes[0]
    ticks = [float(t) for t in axis.get_xticks()]
    assert all(math.log2(t).is_integer() for t in ticks) and 2 <= len(ticks) <= 10  # powers of two only, spaced
    assert estimate.max_batch_size not in ticks  # the largest batch is a marked line, not a crowding tick
    labels = [text.get_text() for ax in figure.axes if ax.get_legend() for text in ax.get_legend().get_texts()]
    assert f"largest batch that fits: {estimate.max_batch_size:,}" in labels
    assert "VRAM (8 GiB)" in labels and "rule of thumb" in labels and "device images/s" in labels
    assert "allocator and context included" in axis.get_title()
    path = plots.plot_memory(estimate, tmp_path / "memory.png")
    assert Path(path).stat().st_size > 10_000


def test_advise_times_the_model_at_the_largest_batch_that_fits() -> None:
    """From memory to data rate: the batch that fits, the step there, the images/s the loader must deliver."""
    from pipeline.measure.advise.diagnosis import model_consumption

    limited = model_consumption(small_cnn(), "3,32,32", batch_size=8, vram="64MiB", device="cpu", seconds=0.2)
    estimate = estimate_memory(small_cnn(), (3, 32, 32), optimizer="sgd", vram="64MiB", for_device="cpu")
    assert limited.batch_size == estimate.max_batch_size and limited.vram_bytes == 64 * MiB
    assert limited.images_per_s == pytest.approx(limited.batch_size / limited.step_seconds)
    assert [row[0] for row in limited.rows] == [row.batch_size for row in estimate.rows]
    assert all(memory == estimate.memory_for_batch(batch) for batch, memory, *_ in limited.rows)
    plain = model_consumption(small_cnn(), "3,32,32", batch_size=8, device="cpu", seconds=0.2)
    if not torch.cuda.is_available():  # no limit known: the batch asked for
        assert plain.batch_size == 8 and plain.vram_bytes is None and plain.rows == ()
