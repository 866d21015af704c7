"""Qwen2: the Llama block with biases on the q/k/v projections (ModelConfig.attention_bias)."""
from kvship.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
