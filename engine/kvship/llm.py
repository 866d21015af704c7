"""Offline use: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from kvship.config import OFFLINE_SCHEDULE_POLICY, EngineConfig
from kvship.core.engine import LLMEngine
from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams


class LLM:
    """``shutdown()``, or leaving ``with LLM(...) as llm:``, gives back the GPU memory (weights,
    KV cache, CUDA graphs) and stops tensor-parallel ranks; so does dropping the last reference,
    which also leaves the model to whoever still holds it."""

    def __init__(self, model: str | None = None, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **{"schedule_policy": OFFLINE_SCHEDULE_POLICY, **config}))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.shutdown(release_memory=False)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts are strings (tokenized with the model's tokenizer) or token-id lists.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        if "engine" not in self.__dict__:
            raise RuntimeError("this LLM has been shut down")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, Seq) else [params] * len(prompts)
        loras = lora_request if isinstance(lora_request, Seq) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        order = []
        for prompt, p, lora in zip(prompts, per_prompt, loras):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, lora_request=lora, final_only=True)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in order]
