"""Types shared by every way of finding a model: lazy tensors and the source."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .pooling import Pooling
from .tokenizer import Tokenizer


class WeightRef:
    """A tensor that is read from disk only when asked for.

    `shape` and `dtype` describe what `load()` returns (quantized GGUF tensors come back as
    float32). `load(slices)` returns only the requested part; formats that can read a part
    without reading the whole tensor do so."""

    __slots__ = ("shape", "dtype", "_loader")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 loader: Callable[[tuple[slice, ...] | None], torch.Tensor]) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self._loader = loader

    def load(self, slices: tuple[slice, ...] | None = None) -> torch.Tensor:
        if slices is not None and not isinstance(slices, tuple):
            slices = (slices,)
        t = self._loader(slices)
        return t

    def __repr__(self) -> str:
        return f"WeightRef(shape={self.shape}, dtype={self.dtype})"


@dataclass
class ModelSource:
    name: str
    path: str
    hf_config: dict
    generation_config: dict
    tokenizer: Tokenizer
    _weights: Callable[[], Iterator[tuple[str, WeightRef]]] = field(repr=False, default=None)
    pooling: Pooling | None = None  # declared by a sentence-transformers folder (an embedding model)

    def weights(self) -> Iterator[tuple[str, WeightRef]]:
        """(HF parameter name, lazy tensor) for every tensor the checkpoint holds."""
        if self._weights is None:
            return iter(())
        return self._weights()


class RowView:
    """Rows [start, start + size) of a lazy tensor (a WeightRef or a QuantRef), itself lazy: a
    checkpoint's fused matrix (Phi-3's qkv_proj) seen as the parts the model loads one by one."""

    def __init__(self, ref, start: int, size: int) -> None:
        self.ref, self.start, self.size = ref, start, size
        self.shape = (size, *tuple(ref.shape)[1:]) if ref.shape is not None else None
        self.dtype = ref.dtype

    def load(self, slices: tuple[slice, ...] | None = None):
        if slices is not None and not isinstance(slices, tuple):
            slices = (slices,)
        first, rest = (slices[0], slices[1:]) if slices else (slice(None), ())
        lo, hi, _ = first.indices(self.size)
        return self.ref.load((slice(self.start + lo, self.start + hi), *rest))


def apply_slices(t: torch.Tensor, slices: tuple[slice, ...] | None) -> torch.Tensor:
    if not slices:
        return t
    return t[slices].contiguous()
