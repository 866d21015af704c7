"""Quantized weights: one canonical form (tensor.py), the checkpoint formats that produce it
(formats.py) and in-situ quantization of 16-bit weights (insitu.py). Layers store and multiply
it (kvship.layers.linear, kvship.kernels.quant_linear)."""
from __future__ import annotations

from dataclasses import dataclass

from .formats import CheckpointFormat, QuantRef, UnsupportedQuantization, checkpoint_format, group_tensors
from .insitu import INSITU_METHODS, quantize
from .tensor import QuantizedTensor


@dataclass(frozen=True)
class QuantScheme:
    """How a model's linear layers are stored: ``checkpoint``, the format its quantized
    tensors come in (None: 16-bit tensors); ``insitu``, the method that quantizes 16-bit
    tensors while loading (None: they stay 16-bit); ``cpu_format``, how a CPU multiplies
    them: "auto", "int4" or "int8" (kernels/cpu_quant_linear.py) or "float32" (dequantized at load: the reference,
    which models built directly get; the engine sets its --cpu-weight-format)."""

    checkpoint: str | None = None
    insitu: str | None = None
    cpu_format: str = "float32"

    @property
    def cpu_integer_format(self) -> str | None:
        """The CPU's integer product ("auto", "int4", "int8"), or None: dequantized (float32)."""
        return None if self.cpu_format == "float32" else self.cpu_format

    def describe(self) -> str:
        if self.insitu is None:
            return self.checkpoint
        return f"in-situ {self.insitu}" + (f" (from {self.checkpoint})" if self.checkpoint else "")


__all__ = ["CheckpointFormat", "INSITU_METHODS", "QuantRef", "QuantScheme", "QuantizedTensor",
           "UnsupportedQuantization", "checkpoint_format", "group_tensors", "quantize"]
