"""How an embedding model turns its last hidden states into one vector per input, read from the
files sentence-transformers saves beside the weights: modules.json (the pipeline) and the
Pooling module's config.json. Models without them that are served for embeddings get
DEFAULT_POOLING, the recipe of decoder embedding models such as Qwen3-Embedding."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import ModelSourceError

POOLING_MODES = ("last", "mean", "cls")
# sentence-transformers' Pooling config key -> our mode
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_NAMED = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Pooling:
    mode: str  # "last" (the last token's state), "mean" (over every token) or "cls" (the first token's)
    normalize: bool  # scaled to unit length (cosine similarity = dot product)
    # Matryoshka models were trained so that a prefix of the vector is itself an embedding:
    # those sizes may be asked for (OpenAI's `dimensions`). () -> any size up to the full one;
    # None -> the model is not a Matryoshka model: only the full size.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def allows_dimensions(self, dimensions: int, full: int) -> bool:
        if dimensions == full:
            return True
        if self.matryoshka_dimensions is None:
            return False
        return (0 < dimensions <= full if not self.matryoshka_dimensions
                else dimensions in self.matryoshka_dimensions)


DEFAULT_POOLING = Pooling("last", True)


def _matryoshka(hf_config: dict) -> tuple[int, ...] | None:
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if hf_config.get("is_matryoshka") else None


def read_pooling(folder: str, hf_config: dict) -> Pooling | None:
    """The pooling a sentence-transformers folder declares; None when the folder has no
    modules.json (not saved as a sentence-transformers model). A pipeline step kvship does not
    run (a Dense projection, max pooling, ...) is refused rather than skipped: its vectors would
    be wrong."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
        mode, normalize = None, False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Transformer":
                continue
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                with open(os.path.join(folder, m.get("path", ""), "config.json")) as f:
                    mode = _st_pooling_mode(json.load(f))
            else:
                raise ModelSourceError(f"{folder!r}: the sentence-transformers module {m.get('type')!r} is not "
                                       "supported (kvship runs Transformer, Pooling and Normalize).")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelSourceError(f"{folder!r}: cannot read its sentence-transformers configuration: {exc}") from None
    if mode is None:
        raise ModelSourceError(f"{folder!r}: modules.json has no Pooling module.")
    return Pooling(mode, normalize, _matryoshka(hf_config))


def _st_pooling_mode(cfg: dict) -> str:
    named = cfg.get("pooling_mode")  # some releases write the mode by name
    if isinstance(named, str) and not any(cfg.get(k) for k in (*_ST_MODES, *_ST_UNSUPPORTED)):
        if named not in _ST_NAMED:
            raise ValueError(f"pooling {named!r} is not supported (one of: lasttoken, mean, cls)")
        cfg = {**cfg, _ST_NAMED[named]: True}
    on = [k for k in (*_ST_MODES, *_ST_UNSUPPORTED) if cfg.get(k)]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ValueError(f"pooling {on or 'none'} is not supported (one of: last token, mean, CLS)")
    if not cfg.get("include_prompt", True):
        raise ValueError("pooling that leaves the instruction prompt out (include_prompt: false) is not supported")
    return _ST_MODES[on[0]]
