"""The next layer's attention weights read into L2 while a mixture-of-experts layer runs.

An experiment, off unless KVSHIP_L2_WARM names a program count (say 32): at batch 1, inside a
captured decode graph, each routed layer forks a side stream before its experts, reads the next
layer's attention matrices there (kernels/l2_warm.py) and joins it when the experts are done, so
that the next layer's q/k/v and o GEMVs may read from L2. bench/l2_prefetch.py measures the idea
on its own; `KVSHIP_L2_WARM=32 bench/latency.py --shape qwen3-30b-a3b` in the engine.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kvship.kernels.l2_warm import warm_l2

# programs of the warming kernel; 0: off
PROGRAMS = int(os.environ.get("KVSHIP_L2_WARM", "0"))


def side_stream() -> torch.cuda.Stream | None:
    """The stream a model reads on while the experiment is on (made with the model: a stream is not
    made while a graph is captured), else None."""
    return torch.cuda.Stream() if PROGRAMS and torch.cuda.is_available() else None


def matrices(module: nn.Module) -> list[torch.Tensor]:
    """The weight matrices a module's linear layers read: 16-bit weights, or a quantized layer's
    codes and scales (kernels/quant_linear.py's QWeight); vectors (biases, norms) left out."""
    out = []
    for sub in module.modules():
        qw = getattr(sub, "qweight", None)
        if qw is not None:
            out += [qw.qweight, qw.scales]
        elif isinstance(getattr(sub, "weight", None), torch.Tensor) and sub.weight.dim() == 2:
            out.append(sub.weight)
    return out


class WarmDuring:
    """``with WarmDuring(tensors, stream, sink):`` reads ``tensors`` into L2 on ``stream`` while
    the block runs on the current stream, which waits for the read at the block's end."""

    def __init__(self, tensors: list[torch.Tensor], stream: torch.cuda.Stream, sink: torch.Tensor):
        self.tensors, self.stream, self.sink = tensors, stream, sink

    def __enter__(self) -> None:
        fork = torch.cuda.Event()
        fork.record()
        self.stream.wait_event(fork)
        with torch.cuda.stream(self.stream):
            warm_l2(self.tensors, PROGRAMS, self.sink)
            self.join = torch.cuda.Event()
            self.join.record(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.current_stream().wait_event(self.join)


def warmers(layers: nn.ModuleList, tokens: int, stream: torch.cuda.Stream | None) -> list[WarmDuring | None]:
    """Per layer, what to warm during its feed-forward: the next layer's attention matrices for a
    routed layer (one whose MLP holds experts) followed by another, when a one-token CUDA graph is
    being captured; None everywhere else. ``stream``: the side stream (made outside the capture;
    None while the experiment is off)."""
    if not (stream is not None and PROGRAMS and tokens == 1 and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()):
        return [None] * len(layers)
    sink = torch.zeros(1, dtype=torch.int32, device=torch.cuda.current_device())
    routed = [getattr(layer.mlp, "experts", None) is not None for layer in layers]
    return [WarmDuring(matrices(layers[i + 1].self_attn), stream, sink) if routed[i] and i + 1 < len(layers)
            else None for i in range(len(layers))]
