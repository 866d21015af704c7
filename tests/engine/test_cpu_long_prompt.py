"""An 8k-token prompt prefilled in one step on the CPU: memory stays linear in the prompt (the
attention splits the chunk's queries; only the last row's logits are computed)."""
from __future__ import annotations

import threading

import psutil
import pytest
import torch

from conftest import write_word_tokenizer
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

PROMPT = 8000


@pytest.mark.timeout(300)
def test_long_prompt_rss_rise_is_linear(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=PROMPT + 64,
                                   eos_token_id=319, bos_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, cfg.vocab_size)
    # the whole prompt in one step: a padded [heads, 8k, 8k] float32 score tensor alone would be 1 GiB
    llm = LLM(str(tmp_path), device="cpu", max_model_len=PROMPT + 16, max_num_batched_tokens=PROMPT,
              enable_prefix_caching=False, cpu_threads=1)
    ids = [1 + i % 300 for i in range(PROMPT)]
    llm.generate([ids[:64]], SamplingParams(max_tokens=1))  # allocator warm-up
    proc = psutil.Process()
    before = peak = proc.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, proc.memory_info().rss)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        done.set()
        sampler.join()
    rise = max(peak, proc.memory_info().rss) - before
    assert len(out[0].outputs[0].token_ids) == 1
    # the activations of 8k tokens (hidden 64, MLP 128) and one query slice's scores: tens of MB
    assert rise < 150e6, f"RSS rose {rise / 1e6:.0f} MB during an {PROMPT}-token prefill"
