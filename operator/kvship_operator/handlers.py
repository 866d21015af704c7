"""kopf handlers: thin glue between events and the pure builders / status code.

The registry is explicit (``registry``) so that tests and ``main`` run exactly these
handlers. The ``memo`` given to ``kopf.operator`` may carry ``kubeconfig`` (a path) to pick
credentials; otherwise in-cluster or $KUBECONFIG.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import autoscaler as asc
from . import builders as b
from . import metrics_client
from . import spec as s
from . import status as st
from . import tracing
from .kube import Kube, bearer_token
from .schema import SpecError, parse

registry = kopf.OperatorRegistry()
RESOURCE = (s.GROUP, s.VERSION, s.PLURAL)
CHILD_LABELS = {"app.kubernetes.io/managed-by": b.MANAGED_BY, b.INSTANCE_LABEL: kopf.PRESENT}
RETRY_DELAY = 30


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress in annotations (status is schema-pruned); no peering objects needed
    # (one replica, Recreate); no finalizers (no delete handlers: garbage collection
    # removes the children through owner references).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvship.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvship.io", key="last-handled-configuration"
    )
    settings.peering.standalone = True
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.error_backoffs = [1, 2, 5, 10]
    tracing.configure()


@kopf.on.cleanup(registry=registry)
def cleanup(**_: Any) -> None:
    tracing.shutdown()


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    kube = Kube.connect(getattr(memo, "kubeconfig", None))
    memo.kube = kube
    memo.pdb_api_version = kube.pdb_api_version()
    memo.hpa_api_version = kube.hpa_api_version()
    cfg = kube.api.configuration
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        token=bearer_token(cfg),
        scheme="Bearer" if bearer_token(cfg) else None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def contains(actual: Any, desired: Any) -> bool:
    """Whether every field of ``desired`` has the same value in ``actual``."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(map(contains, actual, desired))
    return actual == desired or str(actual) == str(desired)


def _api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except Exception:
        return f"{e.status} {e.reason}"


def refresh_status(kube: Kube, namespace: str, name: str, *, generation: int | None = None) -> dict | None:
    """Recompute status from the children; patch only when it changed. With ``generation``
    the status is stamped as observing that spec generation. Status writes carry the
    resourceVersion they were computed from and are redone on a conflict."""
    for _attempt in range(5):
        cr = kube.get_llmd(namespace, name)
        if cr is None:
            return None
        previous = cr.get("status") or {}
        try:
            parsed = parse(s.LLMDeploymentSpec, cr.get("spec") or {})
        except SpecError:
            return previous  # the reconcile handler reports it
        owner = b.Owner(name, namespace, cr["metadata"]["uid"])
        sts = kube.get("apps/v1", "StatefulSet", namespace, name)
        pods = kube.list_pods(namespace, b.selector_string(owner))
        observed = previous.get("observedGeneration")
        if generation is not None and (observed is None or generation > observed):
            observed = generation
        new = st.compute(owner, parsed, sts=sts, pods=pods, previous=previous, observed_generation=observed)
        if all(previous.get(k) == v for k, v in new.items()):
            return new
        try:
            kube.patch_llmd_status(namespace, name, new, cr["metadata"]["resourceVersion"])
            return new
        except ApiException as e:
            if e.status != 409:
                raise
    raise kopf.TemporaryError("status kept changing while being written", delay=5)


def _report_failure(kube: Kube, cr: Any, previous: dict, reason: str, message: str, generation: int | None) -> bool:
    """Write a Ready=False status; False when it already says exactly that (e.g. on resume),
    so that nothing is written or announced twice."""
    new = st.failed(previous, reason, message, generation)
    if all(previous.get(k) == v for k, v in new.items()):
        return False
    meta = cr["metadata"]
    kube.patch_llmd_status(meta["namespace"], meta["name"], new)
    return True


def ensure_children(kube: Kube, cr: Any, pdb_api_version: str, logger: logging.Logger) -> bool:
    """Build and server-side apply every child of ``cr``; write status. False when the spec
    is invalid (reported in status and as an event); raises kopf errors to retry."""
    meta = cr["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    previous = dict(cr.get("status") or {})
    try:
        parsed = parse(s.LLMDeploymentSpec, dict(cr.get("spec") or {}))
    except SpecError as e:
        message = f"invalid spec: {e}"
        logger.warning(message)
        if _report_failure(kube, cr, previous, "InvalidSpec", message, generation):
            kopf.warn(cr, reason="InvalidSpec", message=message)
        return False  # nothing to retry until the spec changes

    owner = b.Owner(name, namespace, meta["uid"])
    changes = []
    for obj in b.build(owner, parsed, pdb_api_version=pdb_api_version):
        kind, child = obj["kind"], obj["metadata"]["name"]
        try:
            before = kube.get(obj["apiVersion"], kind, namespace, child)
            if kind == "PersistentVolumeClaim" and before is not None and contains(before, obj):
                continue  # claims are nearly immutable, and re-applying one writes even when unchanged
            after = kube.apply(obj)
        except ApiException as e:
            detail = _api_message(e)
            if e.status == 403 and "being terminated" in detail:
                logger.info(f"namespace {namespace} is being deleted; not applying {kind} {child}")
                return False
            message = f"applying {kind} {child} failed: {detail}"
            if _report_failure(kube, cr, previous, "ApplyFailed", message, generation):
                kopf.warn(cr, reason="ApplyFailed", message=message)
            # the object we build is refused (older servers answer 500 for a schema mismatch
            # in server-side apply): retrying will not help, a spec change will
            if e.status in (400, 422) or "failed to create typed patch object" in detail:
                raise kopf.PermanentError(message) from e
            raise kopf.TemporaryError(message, delay=RETRY_DELAY) from e
        if before is None:
            changes.append(f"created {kind} {child}")
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            changes.append(f"updated {kind} {child}")
    changes += ensure_autoscaling_object(kube, cr, owner, parsed, logger)
    if changes:
        message = "; ".join(changes)
        logger.info(message)
        kopf.info(cr, reason="Applied", message=message)
    refresh_status(kube, namespace, name, generation=generation)
    return True


@kopf.on.resume(*RESOURCE, registry=registry)
@kopf.on.create(*RESOURCE, registry=registry)
@kopf.on.update(*RESOURCE, registry=registry)
def reconcile(body: Any, memo: kopf.Memo, logger: logging.Logger, reason: Any = None, **_: Any) -> None:
    cr = dict(body)
    meta = cr["metadata"]
    attrs = tracing.reconcile_attributes(s.KIND, meta["namespace"], meta["name"], meta.get("generation"), str(reason or ""))
    with tracing.span("reconcile LLMDeployment", attrs) as sp:
        ok = ensure_children(memo.kube, cr, memo.pdb_api_version, logger)
        if sp is not None:
            sp.set_attribute("kvship.reconcile.valid_spec", ok)


def _child_event(body: Any, type: str | None, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Status follows the children; a child deleted behind our back is put back."""
    name = (body.get("metadata", {}).get("labels") or {}).get(b.INSTANCE_LABEL)
    kube: Kube | None = getattr(memo, "kube", None)
    if not name or kube is None:
        return
    namespace = body["metadata"]["namespace"]
    if type == "DELETED" and body.get("kind") == "StatefulSet":
        cr = kube.get_llmd(namespace, name)
        if cr is not None and not cr["metadata"].get("deletionTimestamp"):
            logger.info(f"StatefulSet {name} was deleted; re-creating it")
            ensure_children(kube, cr, memo.pdb_api_version, logger)
            return
    refresh_status(kube, namespace, name)


kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_LABELS, registry=registry)(_child_event)
kopf.on.event("", "v1", "pods", labels=CHILD_LABELS, registry=registry)(_child_event)


# ---------------------------------------------------------------------------------------
# autoscaling: an emitted HPA / KEDA ScaledObject, or the built-in autoscaler


def _owned_by(obj: dict | None, owner: b.Owner) -> bool:
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == owner.uid for r in refs)


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
            if current is not None and _owned_by(current, owner):
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
        before = kube.get(wanted["apiVersion"], wanted["kind"], owner.namespace, owner.name)
        after = kube.apply(wanted)
        if before is None:
            changes.append(f"created {wanted['kind']} {owner.name}")
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            changes.append(f"updated {wanted['kind']} {owner.name}")
    except ApiException as e:
        message = f"autoscaling object for {owner.name}: {_api_message(e)}"
        logger.warning(message)
        kopf.warn(cr, reason="AutoscalingFailed", message=message)
    return changes


def _builtin_autoscaling(spec: Any, **_: Any) -> bool:
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


EVENT_REASONS = {"ScaleUp": "ScaledUp", "ScaleDown": "ScaledDown", "OutOfBounds": "ScaledIntoBounds"}


def autoscale_once(kube: Kube, namespace: str, name: str, state: asc.Autoscaler, logger: logging.Logger,
                   *, clock=time.monotonic) -> float:
    """One poll of the built-in autoscaler: scrape, decide, act, report. Returns the
    seconds until the next poll."""
    cr = kube.get_llmd(namespace, name)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return 5.0
    try:
        spec = parse(s.LLMDeploymentSpec, dict(cr.get("spec") or {}))
    except SpecError:
        return 15.0  # the reconcile handler reports it
    a = spec.autoscaling
    owner = b.Owner(name, namespace, cr["metadata"]["uid"])
    pods = kube.list_pods(namespace, b.selector_string(owner))
    scrape = metrics_client.scrape(pods)
    now = clock()
    state.observe(now, scrape.total)
    starting = starting_pods(pods, spec.startup_timeout_seconds)
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


@kopf.daemon(*RESOURCE, registry=registry, when=_builtin_autoscaling, cancellation_timeout=10)
def autoscale(stopped: kopf.DaemonStopped, body: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The built-in autoscaler: a loop per LLMDeployment with builtin autoscaling enabled,
    polling every spec.autoscaling.intervalSeconds (kopf stops it when autoscaling is turned
    off or the provider changes, and when the resource goes away). Its window of samples
    lives in memory: after a restart it scales up at once but waits a whole scale-down window
    before scaling down."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    state = asc.Autoscaler()
    while not stopped:
        try:
            delay = autoscale_once(memo.kube, namespace, name, state, logger)
        except ApiException as e:
            logger.warning(f"autoscaler: API call failed: {_api_message(e)}")
            delay = 5.0
        except Exception:  # noqa: BLE001 - one bad poll must not end the loop
            logger.exception("autoscaler: poll failed")
            delay = 5.0
        stopped.wait(delay)
