"""Pure status computation: children's observed state -> `LLMDeployment.status`.

Conditions follow metav1.Condition (type, status, reason, message, lastTransitionTime,
observedGeneration); `lastTransitionTime` only moves when a condition's status changes.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from . import builders as b
from . import rollout
from . import router_builders as rb
from . import spec as s

READY = "Ready"
MODEL_CACHED = "ModelCached"
WORKLOAD_READY = "WorkloadReady"
SYNCED = "Synced"
PROGRESSING = "Progressing"
TYPES = (READY, MODEL_CACHED, WORKLOAD_READY, SYNCED, PROGRESSING)
ROUTER_READY = "RouterReady"  # only with spec.routing envoy or gateway


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def get_condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def _synced(previous: dict[str, Any] | None, apply_errors: list[str] | None) -> dict[str, Any]:
    """Whether every child matches the spec; None errors: not known here (kept as it was)."""
    if apply_errors:
        return condition(SYNCED, "False", "ApplyFailed", "; ".join(apply_errors))
    if apply_errors is not None:
        return condition(SYNCED, "True", "Applied", "every child matches the spec")
    prev = get_condition(previous, SYNCED)
    if prev:
        return condition(SYNCED, prev["status"], prev["reason"], prev["message"])
    return condition(SYNCED, "Unknown", "Pending", "children not applied yet")


def _pod_problems(pods: list[dict[str, Any]], gpu_resource: str) -> tuple[str, str] | None:
    """The most telling reason why pods are not ready, as (reason, message)."""
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                msg = c.get("message") or "pod cannot be scheduled"
                reason = "InsufficientGPU" if f"Insufficient {gpu_resource}" in msg else "Unschedulable"
                return reason, f"{pod['metadata']['name']}: {msg}"
    for pod in pods:
        st = pod.get("status") or {}
        for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            why = waiting.get("reason")
            if why in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
                return "ImagePullFailed", f"{pod['metadata']['name']}/{cs['name']}: {waiting.get('message') or why}"
            if why == "CrashLoopBackOff" and cs.get("name") == "engine":
                last = (cs.get("lastState") or {}).get("terminated") or {}
                detail = last.get("message") or last.get("reason") or why
                return "EngineCrashing", f"{pod['metadata']['name']}: engine keeps exiting: {detail}"
    return None


def _model_cached(spec: s.LLMDeploymentSpec, pods: list[dict[str, Any]]) -> dict[str, Any]:
    if spec.model.pvc is not None:
        return condition(MODEL_CACHED, "True", "ModelOnPVC", f"model read from PVC {spec.model.pvc.claim_name}")
    failed = None
    running = None
    for pod in pods:
        st = pod.get("status") or {}
        for cs in st.get("initContainerStatuses") or []:
            if cs.get("name") != "fetch-model":
                continue
            state = cs.get("state") or {}
            term = state.get("terminated")
            last = (cs.get("lastState") or {}).get("terminated")
            if term and term.get("exitCode") == 0:
                return condition(MODEL_CACHED, "True", "Downloaded", f"model is in the cache ({b.model_path(spec)})")
            for t in (term, last):
                if t and t.get("exitCode", 0) != 0 and failed is None:
                    failed = f"{pod['metadata']['name']}: {(t.get('message') or t.get('reason') or 'download failed').strip()}"
            if state.get("running"):
                running = pod["metadata"]["name"]
        if any(cs.get("ready") for cs in st.get("containerStatuses") or []):
            return condition(MODEL_CACHED, "True", "Downloaded", f"model is in the cache ({b.model_path(spec)})")
    if failed:
        return condition(MODEL_CACHED, "False", "DownloadFailed", failed)
    if running:
        return condition(MODEL_CACHED, "False", "Downloading", f"{running} is downloading the model")
    return condition(MODEL_CACHED, "Unknown", "Pending", "no pod has started the download yet")


def _workload(spec: s.LLMDeploymentSpec, sts: dict[str, Any] | None, pods: list[dict[str, Any]],
              current_ready: int, old: int) -> dict[str, Any]:
    if sts is None:
        return condition(WORKLOAD_READY, "Unknown", "Pending", "StatefulSet not created yet")
    desired = spec.replicas
    if desired == 0:
        return condition(WORKLOAD_READY, "True", "ScaledToZero", "replicas is 0")
    if current_ready >= desired:
        return condition(WORKLOAD_READY, "True", "AllReplicasReady", f"{current_ready}/{desired} replicas ready")
    problem = _pod_problems(pods, spec.gpu.resource_name)
    if problem:
        return condition(WORKLOAD_READY, "False", problem[0], problem[1])
    if old:
        return condition(WORKLOAD_READY, "False", "RollingUpdate", "pods are being replaced by pods of the new spec")
    return condition(WORKLOAD_READY, "False", "ReplicasNotReady", f"{current_ready}/{desired} replicas ready")


def _progressing(spec: s.LLMDeploymentSpec, sts: dict[str, Any] | None, revision: str | None,
                 views: list[rollout.PodView]) -> dict[str, Any]:
    """Complete only once nothing is left to change: the StatefulSet at the spec's replicas
    and its controller agreeing, every pod on the current revision and ready, none
    terminating. Anything that waits on the condition (kubectl wait, a CI step) moves on then."""
    desired = spec.replicas
    if sts is None:
        return condition(PROGRESSING, "True", "Pending", "StatefulSet not created yet")
    if revision is None:
        return condition(PROGRESSING, "True", "Pending", "the StatefulSet controller has not taken the new spec yet")
    live = [v for v in views if not v.terminating]
    current = [v for v in live if v.revision == revision]
    old = [v for v in live if v.revision != revision]
    ready = sum(v.ready for v in current)
    if old:
        return condition(PROGRESSING, "True", "RollingOut",
                         f"{len(current)} pod(s) on the current spec ({ready} ready, {desired} wanted); "
                         f"{len(old)} on a previous spec ({sum(v.ready for v in old)} ready) serve until replaced")
    waiting = []
    terminating = sorted(v.name for v in views if v.terminating)
    if terminating:
        waiting.append(f"{', '.join(terminating)} terminating")
    if ready < desired:
        waiting.append(f"{ready}/{desired} replicas ready")
    if len(current) > desired:
        waiting.append(f"{len(current)} pods for {desired} replica(s)")
    sts_replicas = (sts.get("spec") or {}).get("replicas")
    if sts_replicas != desired:
        waiting.append(f"the StatefulSet at {sts_replicas} replica(s)")
    # The controller's own counts must agree too (they include terminating pods). With
    # OnDelete it never advances currentRevision (kubernetes#73492): updatedReplicas stands in.
    got = sts.get("status") or {}
    counts = [got.get(k) or 0 for k in ("replicas", "updatedReplicas", "readyReplicas")]
    in_step = got.get("currentRevision") == revision or counts[1] == desired
    if not waiting and (counts != [desired] * 3 or not in_step):
        waiting.append(f"the StatefulSet controller's counts ({counts[0]} pods, {counts[1]} updated, "
                       f"{counts[2]} ready)")
    if waiting:
        reason = "RollingOut" if any(v.terminating and v.revision != revision for v in views) else "Scaling"
        return condition(PROGRESSING, "True", reason, f"waiting for {'; '.join(waiting)}")
    return condition(PROGRESSING, "False", "Complete", f"all {desired} replica(s) run the current spec")


def router_status(owner: b.Owner, spec: s.LLMDeploymentSpec,
                  router: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(status.router, the RouterReady condition) from the router Deployment; (None, None)
    without routing."""
    if not rb.routed(spec):
        return None, None
    ready = int(((router or {}).get("status") or {}).get("readyReplicas") or 0)
    view = {"mode": spec.routing.mode, "replicas": spec.routing.replicas, "readyReplicas": ready,
            "picker": f"{rb.router_name(owner)}.{owner.namespace}.svc:{rb.PICKER_PORT}"}
    if router is None:
        return view, condition(ROUTER_READY, "False", "NotCreated", f"Deployment {rb.router_name(owner)} not there yet")
    if ready == 0:
        return view, condition(ROUTER_READY, "False", "Starting", f"no ready pod of Deployment {rb.router_name(owner)}")
    return view, condition(ROUTER_READY, "True", "Ready", f"{ready}/{spec.routing.replicas} router pod(s) ready")


def merge_conditions(
    previous: list[dict[str, Any]], new: list[dict[str, Any]], generation: int | None, now: str
) -> list[dict[str, Any]]:
    """Stamp observedGeneration and keep lastTransitionTime unless status changed."""
    old = {c.get("type"): c for c in previous or []}
    out = []
    for c in new:
        c = dict(c)
        prev = old.get(c["type"])
        c["lastTransitionTime"] = prev["lastTransitionTime"] if prev and prev.get("status") == c["status"] and prev.get("lastTransitionTime") else now
        if generation is not None:
            c["observedGeneration"] = generation
        out.append(c)
    return out


def compute(
    owner: b.Owner,
    spec: s.LLMDeploymentSpec,
    *,
    sts: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    previous: dict[str, Any] | None,
    observed_generation: int | None,
    now: str | None = None,
    apply_errors: list[str] | None = None,
    served: dict[str, str] | None = None,
    router: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole status for a valid spec. ``apply_errors``: children the server refused in
    this reconcile (None when not reconciling: the previous Synced condition stays).
    ``served``: pod name -> the model it serves, for the ready pods (what they report)."""
    now = now or now_rfc3339()
    served = served or {}
    synced = _synced(previous, apply_errors)
    revision = rollout.update_revision(sts)
    views = [rollout.pod_view(p) for p in pods]
    live = [v for v in views if not v.terminating]
    current = [v for v in live if revision is not None and v.revision == revision]
    old = [v for v in live if revision is not None and v.revision != revision]
    current_names = {v.name for v in current}
    cached = _model_cached(spec, [p for p in pods if p["metadata"]["name"] in current_names])
    current_ready = sum(v.ready for v in current)
    ready_replicas = sum(v.ready for v in live)
    workload = _workload(spec, sts, pods, current_ready, len(old))
    serving = ", ".join(sorted(set(served.values()))) or None
    if sts is None and synced["status"] == "False":
        ready = condition(READY, "False", "ApplyFailed", synced["message"])
    elif spec.replicas == 0:
        ready = condition(READY, "False", "ScaledToZero", "replicas is 0")
    elif current_ready >= spec.replicas:
        ready = condition(READY, "True", "Serving", f"OpenAI API at {b.endpoint(owner, spec)} ({serving})")
    elif cached["status"] == "False" and cached["reason"] == "DownloadFailed":
        ready = condition(READY, "False", "DownloadFailed", cached["message"])
    elif ready_replicas > 0:
        why = "ServingPreviousSpec" if any(v.ready for v in old) else "PartiallyServing"
        ready = condition(READY, "True", why, f"{ready_replicas} ready replica(s) serve {serving}; "
                          f"{current_ready}/{spec.replicas} on the current spec")
    else:
        ready = condition(READY, "False", workload["reason"], workload["message"])
    router_view, router_ready = router_status(owner, spec, router)
    if spec.routing.mode == "envoy" and router_ready["status"] != "True" and ready["status"] == "True":
        # the Service sends every request through the router
        ready = condition(READY, "False", "RouterNotReady", router_ready["message"])
    conditions = [ready, cached, workload, synced, _progressing(spec, sts, revision, views)]
    return {
        "observedGeneration": observed_generation,
        "replicas": len(live),
        "readyReplicas": ready_replicas,
        "updatedReplicas": len(current),
        "updatedReadyReplicas": current_ready,
        "servingModel": serving,
        "selector": b.selector_string(owner),
        "endpoint": b.endpoint(owner, spec),
        "servedModelName": b.served_model_name(owner, spec),
        "router": router_view,
        "conditions": merge_conditions(
            (previous or {}).get("conditions") or [],
            conditions + ([router_ready] if router_ready else []), observed_generation, now,
        ),
    }


def failed(
    previous: dict[str, Any] | None, reason: str, message: str, observed_generation: int | None, now: str | None = None
) -> dict[str, Any]:
    """Status for a spec the operator cannot act on (invalid, or applying failed)."""
    now = now or now_rfc3339()
    prev_conditions = (previous or {}).get("conditions") or []
    keep = [c for c in prev_conditions if c.get("type") in (*TYPES, ROUTER_READY) and c.get("type") != READY]
    conditions = [condition(READY, "False", reason, message)] + [
        {k: v for k, v in c.items() if k not in ("lastTransitionTime", "observedGeneration")} for c in keep
    ]
    return {
        "observedGeneration": observed_generation,
        "conditions": merge_conditions(prev_conditions, conditions, observed_generation, now),
    }
