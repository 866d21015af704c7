"""The checks a spec must pass before anything is built from it: the ones the CRD's schema
cannot make on every server (CEL rules, the name, engine.args against the engine's own
parser). One function, called by the reconciler and by the admission webhook alike."""
from __future__ import annotations

from . import engine_args
from . import spec as s
from .schema import parse


def valid_spec(cr: dict) -> s.LLMDeploymentSpec:
    """The parsed spec of the LLMDeployment ``cr``; SpecError when a check refuses it."""
    parsed = parse(s.LLMDeploymentSpec, dict(cr.get("spec") or {}))
    s.check_name(cr["metadata"]["name"])
    routed_events = parsed.routing.mode != "service" and parsed.routing.kv_events
    engine_args.check(parsed.engine.args, {"kv_events_config": "spec.routing.kvEvents (the operator points the "
                                           "router at the events; set kvEvents false to configure them yourself)"}
                      if routed_events else None)
    return parsed
