"""HF-format model folders: config.json, *.safetensors (single or sharded with an index),
tokenizer files, generation_config.json."""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from kvship.quant import checkpoint_format, group_tensors

from .errors import ModelSourceError
from .pooling import read_pooling
from .source import ModelSource, WeightRef
from .tokenizer import Tokenizer

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"cannot read {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path!r} does not hold a JSON object")
    return data


def safetensors_files(path: str) -> dict[str, str]:
    """tensor name -> file for the checkpoint in `path`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ModelSourceError(
                f"{path!r} is missing safetensors shards listed in its index: {', '.join(missing)}; "
                "download the model again.")
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        other = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (" It holds PyTorch pickle weights, which are not loaded for safety; convert them to "
                "safetensors (model.save_pretrained(..., safe_serialization=True)).") if other else ""
        raise ModelSourceError(f"{path!r} has a config.json but no *.safetensors weights.{hint}")
    out: dict[str, str] = {}
    for f in files:
        full = os.path.join(path, f)
        try:
            with safe_open(full, framework="pt") as st:
                for k in st.keys():
                    out[k] = full
        except Exception as e:  # safetensors raises its own error types
            raise ModelSourceError(f"cannot read {full!r}: {e}") from None
    return out


def _make_ref(file: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WeightRef:
    def load(slices: tuple[slice, ...] | None) -> torch.Tensor:
        with safe_open(file, framework="pt") as st:
            if not slices:
                return st.get_tensor(name)
            return st.get_slice(name)[slices].contiguous()

    return WeightRef(shape, dtype, load)


def _refs(files: dict[str, str]) -> Iterator[tuple[str, WeightRef]]:
    """WeightRefs in checkpoint order, opening each file once to read shapes and dtypes."""
    by_file: dict[str, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        try:
            with safe_open(f, framework="pt") as st:
                meta = []
                for name in names:
                    sl = st.get_slice(name)
                    meta.append((name, tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), torch.float32)))
        except Exception as e:  # safetensors raises its own error types
            raise ModelSourceError(f"cannot read {f!r}: {e}; download the model again.") from None
        for name, shape, dtype in meta:
            yield name, _make_ref(f, name, shape, dtype)


def load_hf_folder(path: str, name: str | None = None, require_weights: bool = True) -> ModelSource:
    path = os.path.abspath(path)
    if not is_hf_folder(path):
        raise ModelSourceError(f"{path!r} is not a model folder (no config.json).")
    cfg = _read_json(os.path.join(path, "config.json"))
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    # require_weights=False: a config-only folder, served with random weights (benchmarks).
    files = safetensors_files(path) if require_weights else None
    tokenizer = Tokenizer.from_hf_folder(path, generation_config=gen)

    if "torch_dtype" not in cfg and "dtype" in cfg:  # transformers >= 5 writes "dtype"
        cfg["torch_dtype"] = cfg["dtype"]


    fmt = checkpoint_format(cfg.get("quantization_config"))

    def weights() -> Iterator[tuple[str, WeightRef]]:
        refs = _refs(files if files is not None else safetensors_files(path))
        return refs if fmt is None else group_tensors(refs, fmt)  # each quantized layer as one tensor

    return ModelSource(name=name or os.path.basename(path.rstrip(os.sep)), path=path, hf_config=cfg,
                       generation_config=gen, tokenizer=tokenizer, _weights=weights, pooling=read_pooling(path, cfg))
