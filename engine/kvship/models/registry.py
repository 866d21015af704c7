"""The model class for each family (ModelConfig.architecture). Qwen2 and Qwen3 are the Llama
block with switches that ModelConfig sets (q/k/v biases, per-head q/k norms), and Mixtral and
Qwen2/3-MoE the same block with routed experts; a family with layers of its own gets its own
file and its own entry here."""
from __future__ import annotations

from kvship.models.config import ModelConfig
from kvship.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvship.models.gemma import GemmaForCausalLM
from kvship.models.glm4_moe import Glm4MoeForCausalLM
from kvship.models.gpt_oss import GptOssForCausalLM
from kvship.models.llama import LlamaForCausalLM
from kvship.models.llama4 import Llama4ForCausalLM
from kvship.models.minimax_m2 import MiniMaxM2ForCausalLM
from kvship.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV2ForCausalLM,  # V2's model, V3's router (ModelConfig.moe_scoring)
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3NextForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "llama4": Llama4ForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.architecture]
