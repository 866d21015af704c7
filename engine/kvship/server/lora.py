"""LoRA adapters over the API, as vLLM serves them: a request's ``model`` names the base model or
an adapter (``--lora-modules name=path``), ``/v1/models`` lists adapters with their ``parent``,
and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change the list at run time when
the server allows it (``--allow-runtime-lora-updating``). An unloaded adapter's requests in
flight finish with it; a name loaded again gets a new id (so no prefix-cache hit on old blocks)."""
from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from pydantic import BaseModel

from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.sampling_params import InvalidParamsError, SamplingParams
from kvship.server.engine_client import EngineClient
from kvship.server.errors import APIError, bad_request

router = APIRouter()


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        spec = json.loads(text)
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path


class LoRARegistry:
    """The adapters this server serves, by the name clients use."""

    def __init__(self, enabled: bool, allow_runtime_updates: bool = False):
        self.enabled = enabled
        self.allow_runtime_updates = allow_runtime_updates
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new_request(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None


class AdapterEngine:
    """The engine as one adapter's requests see it: generate() runs with the adapter and the
    responses carry its name; everything else is the engine's own."""

    def __init__(self, engine: EngineClient, lora: LoRARequest):
        self._engine = engine
        self.lora = lora
        self.model_name = lora.lora_name

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                 final_only: bool = False) -> AsyncIterator[RequestOutput]:
        return self._engine.generate(prompt_token_ids, params, request_id, arrival_time, lora_request or self.lora,
                                     final_only)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _registry(request: Request) -> LoRARegistry:
    loras: LoRARegistry = request.app.state.kvship.loras
    if not loras.enabled:
        raise bad_request("LoRA adapters are not enabled on this server (kvship serve --enable-lora)", code="lora_disabled")
    if not loras.allow_runtime_updates:
        raise bad_request("Loading and unloading LoRA adapters at run time is off "
                          "(kvship serve --allow-runtime-lora-updating)", code="lora_updates_disabled")
    return loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoRAAdapterRequest):
    loras = _registry(request)
    state = request.app.state.kvship
    engine = state.engine_or_503()
    if body.lora_name in loras.adapters or body.lora_name == state.model_name:
        raise bad_request(f"The LoRA adapter `{body.lora_name}` is already loaded.", param="lora_name",
                          code="lora_exists")
    lora = loras.new_request(body.lora_name, body.lora_path)
    try:
        await asyncio.wrap_future(engine.add_lora(lora))
    except InvalidParamsError as e:
        if e.param == "lora_path":  # no such folder or hub id
            raise APIError(404, str(e), param="lora_path", code="lora_not_found") from None
        raise bad_request(str(e), param="lora_path", code="lora_unsupported") from None
    loras.adapters[lora.lora_name] = lora
    return f"Success: LoRA adapter '{lora.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterRequest):
    loras = _registry(request)
    if loras.adapters.pop(body.lora_name, None) is None:
        raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded.", param="lora_name",
                       code="model_not_found")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def adapter_cards(loras: LoRARegistry, parent: str, created: int) -> list[dict]:
    return [{"id": name, "object": "model", "created": created, "owned_by": "kvship", "root": lora.lora_path,
             "parent": parent} for name, lora in loras.adapters.items()]
