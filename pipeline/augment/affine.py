"""RandomAffine: ultralytics' `RandomPerspective` matrix, drawn in its order from its formulas.

M = T S R P C: C puts the input's centre at the origin, P tilts (perspective),
R rotates by `degrees` and scales by 1 +- `scale`, S shears (degrees), T
moves the centre to a random point within `translate` of the output's
centre. Boxes go through M (their corners' box), are clipped to the output
and filtered by `warp.box_candidates` against their size times the scale.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .warp import Uniform


@dataclasses.dataclass(frozen=True)
class RandomAffine:
    """Rotation (+- `degrees`), shift (+- `translate` of the output), scale (1 +- `scale`),
    shear (+- `shear` degrees) and perspective (+- `perspective`), as ultralytics' hyperparameters."""

    degrees: float = 0.0
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    perspective: float = 0.0

    def __post_init__(self) -> None:
        for name in ("degrees", "translate", "scale", "shear", "perspective"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RandomAffine({name}={value!r}): a finite number >= 0")

    def matrix(self, rng: Uniform, source: tuple[int, int], out: tuple[int, int]) -> tuple[np.ndarray, float]:
        """(M, s): the 3x3 map of the `source` (width, height) picture into the `out` one, and its scale."""
        centre = np.eye(3)
        centre[0, 2], centre[1, 2] = -source[0] / 2, -source[1] / 2
        tilt = np.eye(3)
        tilt[2, 0] = rng.uniform(-self.perspective, self.perspective)
        tilt[2, 1] = rng.uniform(-self.perspective, self.perspective)
        angle = rng.uniform(-self.degrees, self.degrees)
        scale = rng.uniform(1 - self.scale, 1 + self.scale)
        cos, sin = math.cos(math.radians(angle)) * scale, math.sin(math.radians(angle)) * scale
        rotate = np.array([[cos, sin, 0.0], [-sin, cos, 0.0], [0.0, 0.0, 1.0]])  # OpenCV's getRotationMatrix2D
        shear = np.eye(3)
        shear[0, 1] = math.tan(math.radians(rng.uniform(-self.shear, self.shear)))
        shear[1, 0] = math.tan(math.radians(rng.uniform(-self.shear, self.shear)))
        move = np.eye(3)
        move[0, 2] = rng.uniform(0.5 - self.translate, 0.5 + self.translate) * out[0]
        move[1, 2] = rng.uniform(0.5 - self.translate, 0.5 + self.translate) * out[1]
        return move @ shear @ rotate @ tilt @ centre, scale
