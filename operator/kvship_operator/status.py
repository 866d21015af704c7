"""Pure status computation: children's observed state -> `LLMDeployment.status`.

Conditions follow metav1.Condition (type, status, reason, message, lastTransitionTime,
observedGeneration); `lastTransitionTime` only moves when a condition's status changes.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from . import builders as b
from . import spec as s

READY = "Ready"
MODEL_CACHED = "ModelCached"
WORKLOAD_READY = "WorkloadReady"
TYPES = (READY, MODEL_CACHED, WORKLOAD_READY)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


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


def _workload(spec: s.LLMDeploymentSpec, sts: dict[str, Any] | None, pods: list[dict[str, Any]]) -> dict[str, Any]:
    if sts is None:
        return condition(WORKLOAD_READY, "Unknown", "Pending", "StatefulSet not created yet")
    st = sts.get("status") or {}
    desired = (sts.get("spec") or {}).get("replicas", 1)
    ready = st.get("readyReplicas") or 0
    if desired == 0:
        return condition(WORKLOAD_READY, "True", "ScaledToZero", "replicas is 0")
    rolled = (st.get("observedGeneration") or 0) >= (sts["metadata"].get("generation") or 0) and (
        st.get("updatedReplicas", desired) >= desired or st.get("currentRevision") == st.get("updateRevision")
    )
    if ready >= desired and rolled:
        return condition(WORKLOAD_READY, "True", "AllReplicasReady", f"{ready}/{desired} replicas ready")
    problem = _pod_problems(pods, spec.gpu.resource_name)
    if problem:
        return condition(WORKLOAD_READY, "False", problem[0], problem[1])
    if ready >= desired:
        return condition(WORKLOAD_READY, "False", "RollingUpdate", "pods are being updated to the new spec")
    return condition(WORKLOAD_READY, "False", "ReplicasNotReady", f"{ready}/{desired} replicas ready")


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
) -> dict[str, Any]:
    """The whole status for a valid spec."""
    now = now or now_rfc3339()
    cached = _model_cached(spec, pods)
    workload = _workload(spec, sts, pods)
    st = (sts or {}).get("status") or {}
    ready_replicas = st.get("readyReplicas") or 0
    if workload["status"] == "True" and workload["reason"] != "ScaledToZero":
        ready = condition(READY, "True", "Serving", f"OpenAI API at {b.endpoint(owner, spec)}")
    elif workload["reason"] == "ScaledToZero":
        ready = condition(READY, "False", "ScaledToZero", "replicas is 0")
    elif cached["status"] == "False" and cached["reason"] == "DownloadFailed":
        ready = condition(READY, "False", "DownloadFailed", cached["message"])
    elif ready_replicas > 0:
        ready = condition(READY, "True", "PartiallyServing", workload["message"])
    else:
        ready = condition(READY, "False", workload["reason"], workload["message"])
    return {
        "observedGeneration": observed_generation,
        "replicas": st.get("replicas") or 0,
        "readyReplicas": ready_replicas,
        "selector": b.selector_string(owner),
        "endpoint": b.endpoint(owner, spec),
        "servedModelName": b.served_model_name(owner, spec),
        "conditions": merge_conditions(
            (previous or {}).get("conditions") or [], [ready, cached, workload], observed_generation, now
        ),
    }


def failed(
    previous: dict[str, Any] | None, reason: str, message: str, observed_generation: int | None, now: str | None = None
) -> dict[str, Any]:
    """Status for a spec the operator cannot act on (invalid, or applying failed)."""
    now = now or now_rfc3339()
    prev_conditions = (previous or {}).get("conditions") or []
    keep = [c for c in prev_conditions if c.get("type") in (MODEL_CACHED, WORKLOAD_READY)]
    conditions = [condition(READY, "False", reason, message)] + [
        {k: v for k, v in c.items() if k not in ("lastTransitionTime", "observedGeneration")} for c in keep
    ]
    return {
        "observedGeneration": observed_generation,
        "conditions": merge_conditions(prev_conditions, conditions, observed_generation, now),
    }
