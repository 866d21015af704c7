"""spec.adapters, as the pod sees it: the engine flags, the read-only mounts of PVC sources, the
path each adapter is loaded from, and the plan (pure) that brings a replica's adapters to the
spec. What a replica holds changes at run time (POST /v1/load_lora_adapter), never through the
pod template: adding or removing an adapter restarts nothing. Only the first adapter, the last
one removed, a claim not mounted yet and a --max-loras bucket outgrown change the template."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from . import spec as s

ADAPTER_MOUNT = "/adapters"  # a PVC source's claim is mounted at /adapters/<claimName>
HUB_CACHE = "/tmp/lora-hub"  # the model cache is read-only in the engine container
MIN_MAX_LORAS = 4


def max_loras(count: int) -> int:
    """GPU slots for ``count`` adapters: the next power of two, at least MIN_MAX_LORAS, so that
    most additions fit the slots the pods already have (a new value rolls the replicas)."""
    slots = MIN_MAX_LORAS
    while slots < count:
        slots *= 2
    return slots


def engine_args(spec: s.LLMDeploymentSpec, user_args: dict[str, Any]) -> list[str]:
    """Flags added to `kvship serve` when adapters are set; ``user_args``: what spec.engine.args
    set (parsed), whose --max-loras / --max-cpu-loras win."""
    if not spec.adapters:
        return []
    out = ["--enable-lora", "--allow-runtime-lora-updating"]
    if "max_loras" not in user_args:
        out += ["--max-loras", str(max_loras(len(spec.adapters)))]
    return out


def engine_env(spec: s.LLMDeploymentSpec) -> list[dict[str, str]]:
    """Hub adapters go to a writable cache (the model cache is read-only in the engine). Set for
    any adapter, not only hub ones, so that a hub adapter added later needs no new template."""
    return [{"name": "HF_HUB_CACHE", "value": HUB_CACHE}] if spec.adapters else []


def claims(spec: s.LLMDeploymentSpec) -> list[str]:
    return sorted({a.source.pvc.claim_name for a in spec.adapters if a.source.pvc is not None})


def _volume_name(index: int) -> str:
    return f"adapters-{index}"  # claim names may be longer than a volume name may be


def volumes(spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    return [{"name": _volume_name(i), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
            for i, c in enumerate(claims(spec))]


def mounts(spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    return [{"name": _volume_name(i), "mountPath": f"{ADAPTER_MOUNT}/{c}", "readOnly": True}
            for i, c in enumerate(claims(spec))]


def adapter_path(adapter: s.Adapter) -> str:
    """What the engine is given as lora_path: the hub id, the URL, or the folder in the pod."""
    src = adapter.source
    if src.pvc is not None:
        root = f"{ADAPTER_MOUNT}/{src.pvc.claim_name}"
        return posixpath.normpath(posixpath.join(root, src.pvc.path.lstrip("/"))) if src.pvc.path else root
    return src.hub or src.url or ""


def desired(spec: s.LLMDeploymentSpec) -> dict[str, str]:
    """adapter name -> lora_path."""
    return {a.name: adapter_path(a) for a in spec.adapters}


def held(models: list[dict[str, Any]]) -> dict[str, str]:
    """adapter name -> lora_path, from an engine's /v1/models (adapters are the cards with a parent)."""
    return {str(m["id"]): str(m.get("root") or "") for m in models if m.get("parent")}


@dataclass(frozen=True)
class Plan:
    unload: list[str]  # first: a name whose source changed is unloaded, then loaded again
    load: list[tuple[str, str]]  # (name, lora_path)

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def plan(want: dict[str, str], have: dict[str, str]) -> Plan:
    """What brings a replica holding ``have`` to ``want`` (both name -> lora_path)."""
    changed = [n for n in want if n in have and have[n] != want[n]]
    unload = sorted([n for n in have if n not in want] + changed)
    load = [(n, p) for n, p in sorted(want.items()) if n not in have or n in changed]
    return Plan(unload, load)
