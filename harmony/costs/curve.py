"""A cost as a function of the microbatch size: :class:`Curve`, measured or linear."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import HarmonyError


def is_amount(v) -> bool:
    """Whether ``v`` is a finite number >= 0 (what every cost and count must be)."""
    return isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


@dataclass(frozen=True)
class Curve:
    """A non-negative function of the microbatch size ``u``.

    Either a table of measured points (piecewise-linear between them, linear
    extrapolation beyond the last two, flat below the first) or
    ``per_sample * u + fixed`` when ``us`` is empty.
    """

    us: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    per_sample: float = 0.0
    fixed: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (
            ("per_sample", self.per_sample),
            ("fixed", self.fixed),
            *(("value", v) for v in self.values),
        ):
            if not is_amount(v):
                raise HarmonyError(
                    f"a cost curve's {name} must be a finite number >= 0, got {v!r}"
                )
        if len(self.us) != len(self.values) or any(
            not isinstance(u, int) or u < 1 for u in self.us
        ):
            raise HarmonyError(
                f"a measured curve needs one value per microbatch size >= 1, got sizes {self.us} "
                f"and {len(self.values)} values"
            )

    @classmethod
    def linear(cls, per_sample: float, fixed: float = 0.0) -> "Curve":
        return cls(per_sample=float(per_sample), fixed=float(fixed))

    @classmethod
    def table(cls, us: Sequence[int], values: Sequence[float]) -> "Curve":
        pairs = sorted(zip(us, values))
        if not pairs:
            raise HarmonyError("a measured curve needs at least one point")
        sizes = [u for u, _ in pairs]
        if len(set(sizes)) != len(sizes):
            dup = sorted({u for u in sizes if sizes.count(u) > 1})
            raise HarmonyError(
                f"a measured curve has several values for microbatch size(s) {dup}: give one each"
            )
        return cls(us=tuple(int(u) for u, _ in pairs), values=tuple(float(v) for _, v in pairs))

    @property
    def measured(self) -> bool:
        return bool(self.us)

    @property
    def max_measured_u(self) -> int | None:
        return self.us[-1] if self.us else None

    def __call__(self, u: float) -> float:
        if not self.us:
            return self.per_sample * u + self.fixed
        us, vs = self.us, self.values
        if len(us) == 1:
            return vs[0] * u / us[0]  # one point: assume proportional to u
        i = bisect.bisect_left(us, u)
        if i < len(us) and us[i] == u:
            return vs[i]
        if i == 0:
            return vs[0]
        if i == len(us):
            i = len(us) - 1  # extrapolate on the last segment
        u0, u1, v0, v1 = us[i - 1], us[i], vs[i - 1], vs[i]
        return max(0.0, v0 + (v1 - v0) * (u - u0) / (u1 - u0))

    def scaled(self, factor: float) -> "Curve":
        return Curve(
            self.us,
            tuple(v * factor for v in self.values),
            self.per_sample * factor,
            self.fixed * factor,
        )
