"""Rollouts that keep serving: the planning (``plan``) is pure; ``current_plan`` reads the
cluster for it and ``replace_pods`` takes a step's deletions.

The StatefulSet uses `updateStrategy: OnDelete`, so its controller never replaces a pod on its
own; the operator does, one replica at a time, with one replica of surge (what KServe and
KubeAI do for LLM servers, whose model loads take minutes):

1. the StatefulSet is scaled to replicas + 1: the extra pod starts on the new spec;
2. old pods that are not ready serve nothing: they are replaced at once;
3. once every pod is ready, one old pod is deleted (it keeps serving through its preStop wait
   while endpoints drop it, then drains its in-flight requests) and the StatefulSet
   re-creates it on the new spec; repeat until no old pod is left;
4. the StatefulSet goes back to replicas: the surge pod, the highest ordinal, drains away.

Ready pods never drop below the replicas that were ready when it began. A new spec that never
becomes ready stalls the rollout at step 1 with the old pods serving; the next spec change
starts over.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from . import builders as b
from . import spec as s
from .apply import APPLIED_ANNOTATION, applied_digest, contains
from .kube import Kube

REVISION_LABEL = "controller-revision-hash"


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    ordinal: int
    revision: Optional[str]
    ready: bool
    terminating: bool


@dataclass
class Plan:
    replicas: int  # what the StatefulSet's replicas should be now
    delete: list[PodView] = field(default_factory=list)  # pods to delete now
    rolling: bool = False  # pods of an older spec remain
    message: str = ""


def pod_view(pod: dict[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    name = meta.get("name", "")
    try:
        ordinal = int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        ordinal = -1
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or [])
    return PodView(name, meta.get("uid", ""), ordinal, (meta.get("labels") or {}).get(REVISION_LABEL),
                   ready and not meta.get("deletionTimestamp"), bool(meta.get("deletionTimestamp")))


def update_revision(sts: dict[str, Any] | None) -> Optional[str]:
    """The StatefulSet's current pod-template revision, once its controller has seen the
    latest template (None before: nothing can be planned on a stale revision)."""
    if not sts:
        return None
    st = sts.get("status") or {}
    if (st.get("observedGeneration") or 0) < (sts["metadata"].get("generation") or 0):
        return None
    return st.get("updateRevision")


def plan(desired: int, revision: Optional[str], pods: list[PodView], current: Optional[int] = None) -> Plan:
    """The next step towards ``desired`` replicas, all on ``revision``. ``current``: the
    StatefulSet's replicas now (kept while the revision is not known yet)."""
    if revision is None:
        return Plan(desired if current is None else current, message="waiting for the StatefulSet controller")
    surge = desired + 1
    live = [p for p in pods if not p.terminating]
    old = [p for p in live if p.revision != revision and 0 <= p.ordinal < surge]
    if desired == 0:
        return Plan(0)
    if not old:
        # the surge pod goes last: only once every pod below it runs and is ready (a
        # replaced pod may still be draining, or its replacement loading)
        surge_serving = any(p.ordinal == desired and p.ready for p in live)
        base = {p.ordinal for p in live if p.ordinal < desired and p.ready}
        if current == surge and surge_serving and (len(base) < desired or any(p.terminating for p in pods)):
            return Plan(surge, [], True, "waiting for the replaced pods before the surge pod goes")
        return Plan(desired)
    total = len(old) + len([p for p in live if p.revision == revision and p.ordinal < surge])
    unready_old = [p for p in old if not p.ready]
    if unready_old:
        return Plan(surge, unready_old, True, f"replacing {len(unready_old)} old pod(s) that serve nothing")
    waiting = [p.name for p in pods if p.terminating] + [p.name for p in live if not p.ready]
    if waiting or len(live) < surge:
        who = ", ".join(waiting) or "the surge pod"
        return Plan(surge, [], True, f"{len(old)} of {total} pods on the previous spec; waiting for {who}")
    victim = max(old, key=lambda p: p.ordinal)
    return Plan(surge, [victim], True, f"{len(old)} of {total} pods on the previous spec; replacing {victim.name}")


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def lock(namespace: str, name: str) -> threading.Lock:
    """One rollout step at a time per LLMDeployment: events of several pods are handled in
    parallel, and two steps planned from the same state would replace two pods at once."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def edited_template_replicas(sts: dict[str, Any] | None, owner: b.Owner, parsed: s.LLMDeploymentSpec) -> int | None:
    """The replicas the operator last applied, when the StatefulSet's pod template was edited
    outside the operator since (the spec unchanged): that edit is repaired in place, and only
    a change of the spec starts a rollout. None otherwise."""
    if sts is None:
        return None
    applied = (sts["metadata"].get("annotations") or {}).get(APPLIED_ANNOTATION)
    for replicas in (parsed.replicas, parsed.replicas + 1):
        wanted = b.statefulset(owner, parsed, replicas)
        if applied_digest(wanted) == applied:
            template = (sts.get("spec") or {}).get("template")
            return None if contains(template, wanted["spec"]["template"]) else replicas
    return None


def current_plan(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec) -> Plan:
    """The next step, planned from the StatefulSet and pods as they are now."""
    sts = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    held = edited_template_replicas(sts, owner, parsed)
    if held is not None:
        return Plan(held, message="restoring the pod template edited outside the operator")
    pods = kube.list_pods(owner.namespace, b.selector_string(owner))
    current = ((sts or {}).get("spec") or {}).get("replicas")
    return plan(parsed.replicas, update_revision(sts), [pod_view(p) for p in pods], current)


def has_step(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec) -> bool:
    """Whether the rollout has a step to take now (the StatefulSet's replicas to change, or
    a pod to replace)."""
    sts = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    if sts is None:
        return False
    step = current_plan(kube, owner, parsed)
    return bool(step.delete) or step.replicas != (sts.get("spec") or {}).get("replicas")


def replace_pods(kube: Kube, owner: b.Owner, step: Plan, logger: logging.Logger) -> list[str]:
    """Delete the pods a rollout step replaces (the StatefulSet re-creates them on the
    current spec)."""
    done = []
    for pod in step.delete:
        if kube.delete_pod(owner.namespace, pod.name, pod.uid):
            logger.info(f"rollout: {step.message}")
            state = "ready" if pod.ready else "not ready"
            done.append(f"replaced pod {pod.name} ({state}) with one of the current spec")
    return done
