"""The engine: runs a model as a chain of layers, pack by pack, on real devices."""

from .decompose import Chain, decompose
from .devices import EmulatedDevice, EmulatedServer
from .engine import Engine
from .lazy_weights import empty_weights, materialize
from .reference_loop import reference_step

__all__ = [
    "Chain",
    "EmulatedDevice",
    "EmulatedServer",
    "Engine",
    "decompose",
    "empty_weights",
    "materialize",
    "reference_step",
]
