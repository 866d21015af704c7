"""Qwen3: the Llama block with an RMSNorm on each query and key head (ModelConfig.qk_norm)."""
from kvship.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
