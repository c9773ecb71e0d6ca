"""The paper's models as real ``torch.nn`` chains, and their cost models.

Every model is a chain of *vLayers*: layer ``i`` feeds layer ``i + 1`` and the
last layer is the loss. A layer returns a tensor or a tuple of tensors; the next
layer receives the tuple unpacked. The loss layer receives the previous output
plus the target (see :func:`forward`).

* :func:`build` makes the chain on any device. On ``meta`` a 40-billion-parameter
  GPT-2 costs no memory.
* :func:`example_input` makes a batch of inputs and targets with the right dtypes.
* :func:`spec` derives a :class:`~harmony.costs.spec.ModelSpec` analytically. It runs
  every layer on ``meta`` tensors at batch size 1, counts FLOPs with
  :class:`~torch.utils.flop_counter.FlopCounterMode` and sizes the tensors that
  autograd saves. Layers with the same structure are measured only once.

The architectures follow the reference profiles of the Harmony authors
(``harmony/data/reference/harmony-1080ti``). The parameter counts and the
number of vLayers match them exactly.
"""

from .configs import Batch, BertConfig, GPT2Config, ResNetConfig, VGGConfig
from .cost_model import spec
from .registry import (
    MODELS,
    ZooEntry,
    build,
    config_of,
    example_input,
    forward,
    layer_init,
)

__all__ = [
    "Batch",
    "BertConfig",
    "GPT2Config",
    "MODELS",
    "ResNetConfig",
    "VGGConfig",
    "ZooEntry",
    "build",
    "config_of",
    "example_input",
    "forward",
    "layer_init",
    "spec",
]
