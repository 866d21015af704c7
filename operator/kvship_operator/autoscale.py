"""Autoscaling on the cluster: the HPA or KEDA ScaledObject a spec asks for, or one poll of
the built-in autoscaler (scrape the pods, let ``autoscaler`` decide, set spec.replicas,
report in status). The loop that polls runs as a kopf daemon in ``handlers``."""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import autoscaler as asc
from . import builders as b
from . import metrics_client, scale_zero, tracing
from . import router_builders as rb
from . import spec as s
from . import status as st
from .apply import api_message, apply_reported, owned_by
from .kube import Kube
from .schema import SpecError
from .validate import valid_spec

EVENT_REASONS = {"ScaleUp": "ScaledUp", "ScaleDown": "ScaledDown", "OutOfBounds": "ScaledIntoBounds",
                 "ScaleFromZero": "ScaledFromZero", "ScaleToZero": "ScaledToZero"}


def ensure_autoscaling_object(kube: Kube, cr: Any, owner: b.Owner, spec: s.LLMDeploymentSpec,
                              logger: logging.Logger) -> list[str]:
    """Apply the HPA or ScaledObject the spec asks for and delete the one it no longer asks
    for (only objects this LLMDeployment owns). A ScaledObject is applied only when KEDA's
    CRD is installed; otherwise a Warning event says so. Failures here are reported, not
    retried: the workload itself is in place."""
    hpa_version = kube.hpa_api_version()
    wanted = b.autoscaling_object(owner, spec, hpa_api_version=hpa_version)
    keda_installed = kube.has_crd(b.KEDA_CRD)
    changes: list[str] = []
    try:
        stale = [(hpa_version, "HorizontalPodAutoscaler")]
        if keda_installed:
            stale.append((b.KEDA_API_VERSION, "ScaledObject"))
        for api_version, kind in stale:
            if wanted is not None and wanted["kind"] == kind:
                continue
            current = kube.get(api_version, kind, owner.namespace, owner.name)
            if current is not None and owned_by(current, owner):
                kube.delete(api_version, kind, owner.namespace, owner.name)
                changes.append(f"deleted {kind} {owner.name}")
        if wanted is None:
            return changes
        if wanted["kind"] == "ScaledObject" and not keda_installed:
            message = (f"autoscaling.provider is keda but the KEDA CRD {b.KEDA_CRD} is not installed; "
                       "no ScaledObject was created (install KEDA, or use provider builtin or hpa)")
            logger.warning(message)
            kopf.warn(cr, reason="KEDANotInstalled", message=message)
            return changes
        changes += apply_reported(kube, wanted)
    except ApiException as e:
        message = f"autoscaling object for {owner.name}: {api_message(e)}"
        logger.warning(message)
        kopf.warn(cr, reason="AutoscalingFailed", message=message)
    return changes


def builtin_enabled(spec: Any, **_: Any) -> bool:
    """Whether a (raw) spec asks for the built-in autoscaler: the daemon's ``when``."""
    a = (spec or {}).get("autoscaling") or {}
    return bool(a.get("enabled")) and (a.get("provider") or "builtin") == "builtin"


def _age_seconds(pod: dict[str, Any], now: dt.datetime) -> float:
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not created:
        return 0.0
    try:
        t = dt.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return 0.0
    return (now - t).total_seconds()


def starting_pods(pods: list[dict[str, Any]], startup_timeout: float, now: dt.datetime | None = None) -> list[str]:
    """Pods created but not ready yet, still within their startup period."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return [
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and not metrics_client.is_ready(p)
        and _age_seconds(p, now) < startup_timeout
    ]


def autoscale_once(kube: Kube, namespace: str, name: str, state: asc.Autoscaler, logger: logging.Logger,
                   *, clock=time.monotonic, pod_address: metrics_client.PodAddress = metrics_client.pod_ip_address,
                   ) -> float:
    """One poll of the built-in autoscaler: scrape, decide, act, report. Returns the
    seconds until the next poll."""
    cr = kube.get_llmd(namespace, name)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return 5.0
    try:
        spec = valid_spec(cr)
    except SpecError:
        return 15.0  # the reconcile handler reports it
    a = spec.autoscaling
    owner = b.Owner(name, namespace, cr["metadata"]["uid"])
    pods = kube.list_pods(namespace, b.selector_string(owner))
    scrape = metrics_client.scrape(pods, pod_address=pod_address)
    now = clock()
    state.observe(now, scrape.total)
    starting = starting_pods(pods, spec.startup_timeout_seconds)
    decision = None
    if a.min_replicas == 0 and rb.routed(spec):
        routers = kube.list_pods(namespace, rb.router_selector_string(owner))
        signal = scale_zero.read_routers(routers, pod_address)
        decision = scale_zero.decide(state, now, spec.replicas, scrape.total, signal, a.idle_seconds)
    if decision is None:
        decision = state.decide(asc.Policy.from_spec(a), now, spec.replicas, starting=len(starting))
    if scrape.failed:
        logger.debug(f"autoscaler: no metrics from {scrape.failed}")

    previous = (cr.get("status") or {}).get("autoscaling") or {}
    new = {
        "provider": "builtin",
        "desiredReplicas": decision.replicas,
        "recommendedReplicas": decision.recommendation,
        "observedLoad": None if decision.load is None else f"{decision.load:.1f}",
        "scrapedPods": len(scrape.per_pod),
        "reason": decision.reason,
        "message": decision.message,
    }
    if decision.changed:
        attrs = {
            **tracing.reconcile_attributes(s.KIND, namespace, name, cr["metadata"].get("generation"), "autoscale"),
            "kvship.autoscaling.current_replicas": spec.replicas,
            "kvship.autoscaling.desired_replicas": decision.replicas,
            "kvship.autoscaling.reason": decision.reason,
        }
        with tracing.span("autoscale LLMDeployment", attrs):
            kube.patch_llmd_replicas(namespace, name, decision.replicas)
        new["lastScaleTime"] = st.now_rfc3339()
        logger.info(f"autoscaler: {decision.message}")
        kopf.info(cr, reason=EVENT_REASONS[decision.reason], message=decision.message)
    elif decision.reason == "NoMetrics" and previous.get("reason") != "NoMetrics" and scrape.failed:
        failed = "; ".join(f"{k}: {v}" for k, v in scrape.failed.items())
        kopf.warn(cr, reason="MetricsUnavailable", message=f"no metrics from the ready pods: {failed}"[:1000])
    if any(previous.get(k) != v for k, v in new.items()):
        kube.patch_llmd_status(namespace, name, {"autoscaling": new})
    return float(a.interval_seconds)
