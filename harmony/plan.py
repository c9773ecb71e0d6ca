"""A Plan: everything a policy needs to turn a model into a schedule.

It is what the search returns and what the engine runs, and it round-trips
through JSON. Packs are half-open layer ranges ``(start, stop)``.

Harmony's packing rules (checked by :meth:`Plan.validate`):

* backward packs cover every layer ``[0, L)`` contiguously;
* the last backward pack is *fused*: it runs forward + loss + backward per
  microbatch, so forward packs cover exactly the layers before it,
  ``[0, bwd_packs[-1][0])`` (empty when one backward pack holds the model);
* the input of every other backward pack is *stashed* to host memory by the
  forward pack that computes it.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .errors import HarmonyError

Pack = tuple[int, int]

#: Policy options and their defaults. Unknown options are rejected.
DEFAULT_OPTIONS: dict[str, Any] = {
    # Activations between two packs that run on the same GPU: keep them on the
    # device (False) or swap them to host memory and back (True).
    "offload_activations": False,
    # Packs whose weights may be resident at once on a GPU (2 = double buffering:
    # the next pack's weights load while the current pack computes).
    "prefetch_packs": 2,
    # A backward pack recomputes its forward as soon as its weights and stashed input
    # are on the GPU, while its output gradient is still on its way (True, Harmony's
    # schedule), or only once the gradient is there (False: the ablation).
    "overlap_recompute": True,
    # The run's precision ("fp32", or mixed "bf16" / "fp16"): what crosses the links
    # in which dtype (harmony.costs.spec.ModelSpec.in_precision). None: the spec's own.
    "precision": None,
    # Where the swapping baselines keep training state (harmony.policies.swapping), as a
    # framework with virtualized GPU memory does; other policies refuse them. The
    # optimizer steps on the GPU: weights, gradients and optimizer state cross in, and
    # weights and state back out, once per iteration and replica (False: on the CPU).
    "gpu_optimizer": False,
    # A pack's gradient accumulates on the GPU: every microbatch after the first brings
    # the accumulator back in before backward (False: each microbatch's gradient goes
    # out and the host adds them up). Either way it leaves after every microbatch.
    "gpu_gradients": False,
}


def split_samples(total: int, size: int) -> list[tuple[int, int]]:
    """Sample ranges of microbatches of ``size`` (the last one may be smaller)."""
    return [(a, min(a + size, total)) for a in range(0, total, size)]


@dataclass(frozen=True)
class Plan:
    policy: str
    n_gpus: int
    minibatch: int
    fwd_microbatch: int
    bwd_microbatch: int
    fwd_packs: tuple[Pack, ...]
    bwd_packs: tuple[Pack, ...]
    options: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        # Normalise lists, dicts and numpy integers into plain hashable values so a
        # Plan is a value; anything malformed is a HarmonyError, not a TypeError.
        for name in ("n_gpus", "minibatch", "fwd_microbatch", "bwd_microbatch"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                object.__setattr__(self, name, int(v))
        for name in ("fwd_packs", "bwd_packs"):
            object.__setattr__(self, name, _normalise_packs(getattr(self, name), name))
        opts = self.options
        if isinstance(opts, Mapping):
            opts = dict(opts)
        else:
            try:
                opts = dict(opts)
            except (TypeError, ValueError):
                raise HarmonyError(
                    f"plan options must be a mapping of option -> value, got {opts!r}"
                ) from None
        unknown = set(opts) - set(DEFAULT_OPTIONS)
        if unknown:
            raise HarmonyError(
                f"unknown plan option(s) {sorted(unknown)}; known options: "
                f"{sorted(DEFAULT_OPTIONS)}"
            )
        object.__setattr__(self, "options", tuple(sorted(opts.items())))

    @classmethod
    def uniform(
        cls,
        policy: str,
        n_gpus: int,
        minibatch: int,
        microbatch: int,
        num_layers: int,
        layers_per_pack: int,
        fwd_microbatch: int | None = None,
        **options: Any,
    ) -> "Plan":
        """Backward packs of ``layers_per_pack`` layers cut from the last layer, so
        the fused last pack is full and the first pack takes the remainder;
        forward packs on the same boundaries (all but the fused pack);
        ``microbatch`` samples per backward microbatch (and forward, unless
        ``fwd_microbatch``); ``options`` as :data:`DEFAULT_OPTIONS`, those equal
        to their default left out."""
        if not isinstance(layers_per_pack, int) or layers_per_pack < 1:
            raise HarmonyError(f"layers_per_pack must be an integer >= 1, got {layers_per_pack!r}")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise HarmonyError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        cuts = list(range(num_layers, 0, -layers_per_pack)) + [0]
        bwd = tuple(reversed([(max(a, 0), b) for b, a in zip(cuts, cuts[1:])]))
        kept = {
            k: v for k, v in options.items() if k not in DEFAULT_OPTIONS or v != DEFAULT_OPTIONS[k]
        }
        return cls(
            policy,
            n_gpus,
            minibatch,
            microbatch if fwd_microbatch is None else fwd_microbatch,
            microbatch,
            bwd[:-1],
            bwd,
            kept,
        )

    # ---- accessors -----------------------------------------------------------
    def option(self, name: str) -> Any:
        return dict(self.options).get(name, DEFAULT_OPTIONS[name])

    def with_options(self, **changes: Any) -> "Plan":
        """The same plan with ``changes`` to its options (those equal to their default left
        out)."""
        merged = {**dict(self.options), **changes}
        return replace(
            self,
            options={
                k: v
                for k, v in merged.items()
                if k not in DEFAULT_OPTIONS or v != DEFAULT_OPTIONS[k]
            },
        )

    @property
    def num_layers(self) -> int:
        return self.bwd_packs[-1][1] if self.bwd_packs else 0

    def fwd_microbatches(self, samples: int | None = None) -> list[tuple[int, int]]:
        return split_samples(self.minibatch if samples is None else samples, self.fwd_microbatch)

    def bwd_microbatches(self, samples: int | None = None) -> list[tuple[int, int]]:
        return split_samples(self.minibatch if samples is None else samples, self.bwd_microbatch)

    def stash_layers(self) -> tuple[int, ...]:
        """Layers whose input forward stashes to host: starts of backward packs
        but the fused last one."""
        return tuple(p[0] for p in self.bwd_packs[:-1])

    # ---- validation ----------------------------------------------------------
    def validate(self, num_layers: int | None = None) -> "Plan":
        """Raise :class:`HarmonyError` saying what is wrong; return self if fine."""

        def bad(msg: str) -> HarmonyError:
            return HarmonyError(f"invalid plan ({self.policy}): {msg}")

        for name in ("n_gpus", "minibatch", "fwd_microbatch", "bwd_microbatch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        for name in ("fwd_microbatch", "bwd_microbatch"):
            if getattr(self, name) > self.minibatch:
                raise bad(
                    f"{name}={getattr(self, name)} is larger than the minibatch ({self.minibatch})"
                )
        if not self.bwd_packs:
            raise bad("bwd_packs is empty: give at least one (start, stop) layer range")
        L = self.num_layers if num_layers is None else num_layers
        _check_cover(self.bwd_packs, 0, L, "bwd_packs", bad)
        _check_cover(
            self.fwd_packs,
            0,
            self.bwd_packs[-1][0],
            "fwd_packs",
            bad,
            why=" (forward packs stop where the fused last backward pack starts)",
        )
        prefetch = self.option("prefetch_packs")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise bad(f"option prefetch_packs must be an integer >= 1, got {prefetch!r}")
        for name in ("offload_activations", "overlap_recompute", "gpu_optimizer", "gpu_gradients"):
            if not isinstance(self.option(name), bool):
                raise bad(f"option {name} must be true or false, got {self.option(name)!r}")
        if self.option("precision") not in (None, "fp32", "bf16", "fp16"):
            raise bad(
                "option precision must be 'fp32', 'bf16' or 'fp16', got "
                f"{self.option('precision')!r}"
            )
        return self

    # ---- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["fwd_packs"] = [list(p) for p in self.fwd_packs]
        d["bwd_packs"] = [list(p) for p in self.bwd_packs]
        d["options"] = dict(self.options)
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        fields = {
            "policy",
            "n_gpus",
            "minibatch",
            "fwd_microbatch",
            "bwd_microbatch",
            "fwd_packs",
            "bwd_packs",
            "options",
        }
        missing = fields - {"options"} - set(d)
        extra = set(d) - fields
        if missing or extra:
            raise HarmonyError(
                f"plan JSON: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}; "
                f"a plan has {sorted(fields)}"
            )
        return cls(**{k: d[k] for k in fields if k in d})

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        text = str(text_or_path)
        if not text.strip():
            raise HarmonyError("plan JSON is empty: give a JSON object or the path of a plan file")
        if not text.lstrip().startswith("{"):
            path = Path(text_or_path)
            if not path.exists():
                raise HarmonyError(f"plan file {str(path)!r} does not exist")
            text = path.read_text()
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise HarmonyError(f"plan JSON is not valid JSON: {e}") from None

    def describe(self) -> str:
        return (
            f"{self.policy} x{self.n_gpus} minibatch {self.minibatch} "
            f"uF={self.fwd_microbatch} uB={self.bwd_microbatch} "
            f"packs F{len(self.fwd_packs)}/B{len(self.bwd_packs)}"
            + ("" if not self.options else " " + ",".join(f"{k}={v}" for k, v in self.options))
        )


def _normalise_packs(packs, name: str) -> tuple[Pack, ...]:
    try:
        out = tuple(tuple(p) for p in packs)
        if any(
            len(p) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in p)
            for p in out
        ):
            raise TypeError
        return tuple((int(a), int(b)) for a, b in out)
    except TypeError:
        raise HarmonyError(
            f"{name} must be a list of [start, stop] integer layer ranges, e.g. [[0, 4], [4, 8]]; "
            f"got {packs!r}"
        ) from None


def _check_cover(packs, start: int, stop: int, name: str, bad, why: str = "") -> None:
    at = start
    for p in packs:
        a, b = p
        if a != at:
            kind = (
                "overlaps the previous pack"
                if a < at
                else f"leaves layers {at}..{a - 1} uncovered"
            )
            raise bad(f"{name}: pack {p} {kind}")
        if b <= a:
            raise bad(f"{name}: pack {p} is empty or reversed (stop must be > start)")
        at = b
    if at != stop:
        raise bad(
            f"{name} must cover layers {start}..{stop - 1}{why}, but they end at layer {at - 1}"
        )


def layer_shard(layers: tuple[int, int], r: int, k: int) -> list[int]:
    """Shard ``r`` of ``k`` of a pack's layers: every k-th layer from the r-th.
    Whole layers, so the bytes of a shard are exact from the spec."""
    return list(range(layers[0] + r, layers[1], k))


def uniform_packs(start: int, stop: int, size: int) -> tuple[Pack, ...]:
    """Contiguous packs of ``size`` layers over [start, stop)."""
    return tuple((a, min(a + size, stop)) for a in range(start, stop, size))
