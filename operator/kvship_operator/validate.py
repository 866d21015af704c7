"""The checks a spec must pass before anything is built from it: the ones the CRD's schema
cannot make on every server (CEL rules, the name, engine.args against the engine's own
parser). One function, called by the reconciler and by the admission webhook alike."""
from __future__ import annotations

from . import builders as b
from . import engine_args
from . import spec as s
from .schema import SpecError, parse


def valid_spec(cr: dict) -> s.LLMDeploymentSpec:
    """The parsed spec of the LLMDeployment ``cr``; SpecError when a check refuses it."""
    parsed = parse(s.LLMDeploymentSpec, dict(cr.get("spec") or {}))
    s.check_name(cr["metadata"]["name"])
    owned = {}
    if parsed.routing.mode != "service" and parsed.routing.kv_events:
        owned["kv_events_config"] = ("spec.routing.kvEvents (the operator points the router at the events; set "
                                     "kvEvents false to configure them yourself)")
    if parsed.adapters:
        owned["lora_modules"] = "spec.adapters (the operator loads them into running replicas)"
    engine_args.check(parsed.engine.args, owned)
    _check_adapter_names(parsed, b.served_model_name(b.Owner(cr["metadata"]["name"], "", ""), parsed))
    return parsed


def _check_adapter_names(spec: s.LLMDeploymentSpec, served: str) -> None:
    """The served name may come from the resource's name, which the CRD's rules cannot see."""
    for i, a in enumerate(spec.adapters):
        if a.name == served:
            raise SpecError(f"spec.adapters[{i}].name", f"{a.name!r} is the served model name: clients could not "
                            "tell the base model from the adapter")
