"""kopf handlers: thin glue between events and the pure builders / status code.

The registry is explicit (``registry``) so that tests and ``main`` run exactly these
handlers. The ``memo`` given to ``kopf.operator`` (see main.operate) carries ``kubeconfig`` (a path, or
None for in-cluster or $KUBECONFIG) and ``pod_address`` (where the autoscaler scrapes a pod).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import threading
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import autoscaler as asc
from . import builders as b
from . import engine_args, metrics_client, rollout, tracing
from . import spec as s
from . import status as st
from .kube import Kube, bearer_token
from .schema import SpecError, parse

registry = kopf.OperatorRegistry()
RESOURCE = (s.GROUP, s.VERSION, s.PLURAL)
CHILD_LABELS = {"app.kubernetes.io/managed-by": b.MANAGED_BY, b.INSTANCE_LABEL: kopf.PRESENT}


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
    # Events are auxiliary and kopf (1.45) retries a failed one over 54 s by default, during
    # which a stopping operator waits: one posted to a namespace being deleted (403,
    # NamespaceTerminating, which no retry mends) held a stop for all of it (CI, 2026-12-04).
    settings.posting.default_backoffs = [1, 2, 4]
    tracing.configure()


@kopf.on.cleanup(registry=registry)
def cleanup(**_: Any) -> None:
    tracing.shutdown()


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    kube = Kube.connect(getattr(memo, "kubeconfig", None))
    kube.pod_address = getattr(memo, "pod_address", None)
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


def valid_spec(cr: dict) -> s.LLMDeploymentSpec:
    """The parsed spec, after every check the CRD cannot make on every server (CEL rules,
    the name, engine.args against the engine's own parser); SpecError otherwise."""
    parsed = parse(s.LLMDeploymentSpec, dict(cr.get("spec") or {}))
    s.check_name(cr["metadata"]["name"])
    engine_args.check(parsed.engine.args)
    return parsed


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


def refresh_status(kube: Kube, namespace: str, name: str, *, generation: int | None = None,
                   apply_errors: list[str] | None = None) -> dict | None:
    """Recompute status from the children; patch only when it changed. With ``generation``
    the status is stamped as observing that spec generation; with ``apply_errors`` (from a
    reconcile) the Synced condition says which children were refused. Status writes carry
    the resourceVersion they were computed from and are redone on a conflict."""
    for _attempt in range(5):
        cr = kube.get_llmd(namespace, name)
        if cr is None:
            return None
        previous = cr.get("status") or {}
        try:
            parsed = valid_spec(cr)
        except SpecError:
            return previous  # the reconcile handler reports it
        owner = b.Owner(name, namespace, cr["metadata"]["uid"])
        sts = kube.get("apps/v1", "StatefulSet", namespace, name)
        pods = kube.list_pods(namespace, b.selector_string(owner))
        observed = previous.get("observedGeneration")
        if generation is not None and (observed is None or generation > observed):
            observed = generation
        served = metrics_client.served_models(pods, kube.pod_address)
        new = st.compute(owner, parsed, sts=sts, pods=pods, previous=previous, observed_generation=observed,
                         apply_errors=apply_errors, served=served)
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


def _quantity_bytes(q: Any) -> float:
    """A storage quantity in bytes (enough to compare claim sizes)."""
    m = re.fullmatch(r"([0-9.]+)([KMGTPE]i?|[eE][0-9]+)?", str(q).strip())
    if not m:
        return float("nan")
    number, unit = float(m.group(1)), m.group(2) or ""
    if unit[:1] in "eE" and unit:
        return number * 10 ** int(unit[1:])
    powers = "KMGTPE"
    if unit.endswith("i"):
        return number * 1024 ** (powers.index(unit[0]) + 1)
    return number * 1000 ** (powers.index(unit) + 1) if unit else number


def claim_change_refused(kube: Kube, before: dict, wanted: dict) -> str | None:
    """Why an existing claim cannot take the spec's change (None: it can). Only growing the
    size is possible, and only through a StorageClass with allowVolumeExpansion."""
    spec_before, spec_wanted = before.get("spec") or {}, wanted["spec"]
    if sorted(spec_before.get("accessModes") or []) != sorted(spec_wanted["accessModes"]):
        return (f"modelCache.accessMode cannot change on the existing claim {wanted['metadata']['name']} "
                f"({spec_before.get('accessModes')} -> {spec_wanted['accessModes']}): delete the claim to re-create it")
    if "storageClassName" in spec_wanted and spec_before.get("storageClassName") != spec_wanted["storageClassName"]:
        return (f"modelCache.storageClassName cannot change on the existing claim {wanted['metadata']['name']}: "
                "delete the claim to re-create it")
    old = ((spec_before.get("resources") or {}).get("requests") or {}).get("storage")
    new = spec_wanted["resources"]["requests"]["storage"]
    if old is None or _quantity_bytes(new) == _quantity_bytes(old):
        return None
    where = f"modelCache.size cannot change from {old} to {new}"
    if _quantity_bytes(new) < _quantity_bytes(old):
        return f"{where}: a claim cannot shrink"
    sc_name = spec_before.get("storageClassName")
    sc = kube.get_storage_class(sc_name) if sc_name else None
    if sc is None or not sc.get("allowVolumeExpansion"):
        which = f"StorageClass {sc_name}" if sc_name else "the claim's (missing) StorageClass"
        return f"{where}: {which} does not allow volume expansion (allowVolumeExpansion)"
    return None


def backoff(retry: int) -> float:
    """Seconds before retrying a failed apply: 5, 10, 20, 40, then every 60."""
    return float(min(60, 5 * 2 ** max(0, retry)))


APPLIED_ANNOTATION = "kvship.io/applied"


def applied_digest(obj: dict) -> str:
    """A digest of what the operator applies to a child, kept on it: a child that still holds
    every field of the same applied object needs no write. (Applying an unchanged object is
    not always free: a 1.20 server rewrites a StatefulSet with volumeClaimTemplates on every
    server-side apply.) A changed spec changes the digest, so fields no longer wanted are
    still removed by the apply."""
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def apply_children(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec, pdb_api_version: str,
                   logger: logging.Logger, replicas: int | None = None) -> tuple[list[str], dict[str, str], bool]:
    """Server-side apply every child, each on its own: one refused child never keeps the
    others from their update. Returns (changes, {"Kind name": error}, namespace_terminating)."""
    changes: list[str] = []
    errors: dict[str, str] = {}
    for obj in b.build(owner, parsed, pdb_api_version=pdb_api_version, replicas=replicas):
        kind, child = obj["kind"], obj["metadata"]["name"]
        try:
            before = kube.get(obj["apiVersion"], kind, owner.namespace, child)
            if kind == "PersistentVolumeClaim" and before is not None:
                if contains(before, obj):
                    continue  # claims are nearly immutable, and re-applying one writes even when unchanged
                refused = claim_change_refused(kube, before, obj)
                if refused:
                    errors[f"{kind} {child}"] = refused
                    continue
            digest = applied_digest(obj)
            if before is not None and contains(before, obj) and \
                    ((before["metadata"].get("annotations") or {}).get(APPLIED_ANNOTATION)) == digest:
                continue  # applied before and unchanged since: write nothing
            obj = {**obj, "metadata": {**obj["metadata"], "annotations": {
                **(obj["metadata"].get("annotations") or {}), APPLIED_ANNOTATION: digest}}}
            if kind == "StatefulSet" and before is not None and not contains(
                    (before.get("spec") or {}).get("volumeClaimTemplates") or [],
                    obj["spec"].get("volumeClaimTemplates") or []):
                # volumeClaimTemplates cannot change: re-create the StatefulSet, leaving its
                # pods running (orphaned, then adopted by the new one and replaced by the rollout)
                kube.delete_orphaning("apps/v1", kind, owner.namespace, child)
                changes.append(f"re-created StatefulSet {child} (model cache claims changed)")
                before = None
            after = kube.apply(obj)
        except ApiException as e:
            detail = _api_message(e)
            if e.status == 403 and "being terminated" in detail:
                logger.info(f"namespace {owner.namespace} is being deleted; not applying {kind} {child}")
                return changes, errors, True
            errors[f"{kind} {child}"] = f"applying {kind} {child} failed: {detail}"
            continue
        if before is None:
            changes.append(f"created {kind} {child}")
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            changes.append(f"updated {kind} {child}")
    return changes, errors, False


def ensure_children(kube: Kube, cr: Any, pdb_api_version: str, logger: logging.Logger, retry: int = 0) -> bool:
    """Build and server-side apply every child of ``cr``; write status. False when the spec
    is invalid (reported in status and as an event). A child the server refuses is reported
    in status (condition Synced, and Ready when no StatefulSet exists) and as an event while
    the other children are applied; then a TemporaryError retries with backoff."""
    meta = cr["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    previous = dict(cr.get("status") or {})
    try:
        parsed = valid_spec(cr)
    except SpecError as e:
        message = f"invalid spec: {e}"
        logger.warning(message)
        if _report_failure(kube, cr, previous, "InvalidSpec", message, generation):
            kopf.warn(cr, reason="InvalidSpec", message=message)
        return False  # nothing to retry until the spec changes

    owner = b.Owner(name, namespace, meta["uid"])
    with _lock(namespace, name):
        step = rollout_plan(kube, owner, parsed)
        changes, errors, terminating = apply_children(kube, owner, parsed, pdb_api_version, logger, step.replicas)
        if terminating:
            return False
        changes += replace_pods(kube, owner, step, logger)
    changes += ensure_autoscaling_object(kube, cr, owner, parsed, logger)
    if changes:
        message = "; ".join(changes)
        logger.info(message)
        kopf.info(cr, reason="Applied", message=message)
    new = refresh_status(kube, namespace, name, generation=generation, apply_errors=list(errors.values()))
    if errors:
        message = "; ".join(errors.values())
        logger.warning(message)
        was = st.get_condition(previous, st.SYNCED)
        if not was or was.get("status") != "False" or was.get("message") != message:
            kopf.warn(cr, reason="ApplyFailed", message=message[:1000])
        raise kopf.TemporaryError(message, delay=backoff(retry))
    return new is not None


@kopf.on.resume(*RESOURCE, registry=registry)
@kopf.on.create(*RESOURCE, registry=registry)
@kopf.on.update(*RESOURCE, registry=registry)
def reconcile(body: Any, memo: kopf.Memo, logger: logging.Logger, reason: Any = None, retry: int = 0,
              **_: Any) -> None:
    cr = dict(body)
    meta = cr["metadata"]
    attrs = tracing.reconcile_attributes(s.KIND, meta["namespace"], meta["name"], meta.get("generation"), str(reason or ""))
    with tracing.span("reconcile LLMDeployment", attrs) as sp:
        ok = ensure_children(memo.kube, cr, memo.pdb_api_version, logger, retry=retry)
        if sp is not None:
            sp.set_attribute("kvship.reconcile.valid_spec", ok)


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(namespace: str, name: str) -> threading.Lock:
    """One rollout step at a time per LLMDeployment: events of several pods are handled in
    parallel, and two steps planned from the same state would replace two pods at once."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def rollout_plan(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec) -> rollout.Plan:
    sts = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    pods = kube.list_pods(owner.namespace, b.selector_string(owner))
    current = ((sts or {}).get("spec") or {}).get("replicas")
    return rollout.plan(parsed.replicas, rollout.update_revision(sts), [rollout.pod_view(p) for p in pods], current)


def replace_pods(kube: Kube, owner: b.Owner, step: rollout.Plan, logger: logging.Logger) -> list[str]:
    """Delete the pods a rollout step replaces (the StatefulSet re-creates them on the
    current spec)."""
    done = []
    for pod in step.delete:
        if kube.delete_pod(owner.namespace, pod.name, pod.uid):
            logger.info(f"rollout: {step.message}")
            state = "ready" if pod.ready else "not ready"
            done.append(f"replaced pod {pod.name} ({state}) with one of the current spec")
    return done


def advance_rollout(kube: Kube, cr: dict, logger: logging.Logger) -> bool:
    """Whether the rollout has a step to take now (the StatefulSet's replicas to change, or
    a pod to replace): then a reconcile takes it."""
    try:
        parsed = valid_spec(cr)
    except SpecError:
        return False
    owner = b.Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    sts = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    if sts is None:
        return False
    step = rollout_plan(kube, owner, parsed)
    return bool(step.delete) or step.replicas != (sts.get("spec") or {}).get("replicas")


def ensure_workers(kube: Kube, cr: dict, leader_pod: dict, logger: logging.Logger) -> None:
    """A multi-node group's workers: a StatefulSet per leader pod, owned by it. Made once per
    leader (a new leader, after a rollout or a restart of its group, gets a new one built
    from the spec then); one still owned by a previous leader is left to garbage collection,
    and its deletion brings us back here."""
    try:
        parsed = valid_spec(cr)
    except SpecError:
        return
    meta = leader_pod["metadata"]
    if not b.multi_node(parsed) or meta.get("deletionTimestamp"):
        return
    owner = b.Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    wanted = b.worker_statefulset(owner, parsed, leader_pod)
    if kube.get("apps/v1", "StatefulSet", owner.namespace, wanted["metadata"]["name"]) is not None:
        return
    kube.apply(wanted)
    logger.info(f"created StatefulSet {wanted['metadata']['name']} (the workers of {meta['name']})")


def drifted(kube: Kube, cr: dict, kind: str, child: str, event_type: str | None, pdb_api_version: str) -> str | None:
    """Why the child ``kind``/``child`` no longer matches what the spec builds (None: it
    does, or it is not a child the spec builds)."""
    try:
        parsed = valid_spec(cr)
    except SpecError:
        return None  # the reconcile handler reports it
    owner = b.Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"])
    replicas = rollout_plan(kube, owner, parsed).replicas if kind == "StatefulSet" else None
    wanted = next((o for o in b.build(owner, parsed, pdb_api_version=pdb_api_version, replicas=replicas)
                   if o["kind"] == kind and o["metadata"]["name"] == child), None)
    if wanted is None:
        return None
    if event_type == "DELETED":
        return "deleted"
    live = kube.get(wanted["apiVersion"], kind, owner.namespace, child)
    if live is None:
        return "deleted"
    if kind == "PersistentVolumeClaim" and claim_change_refused(kube, live, wanted):
        return None  # reported by the reconcile; re-applying cannot fix it
    return None if contains(live, wanted) else "changed"


def _child_event(body: Any, type: str | None, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Status follows the children; a child deleted or edited behind our back is put back
    (re-applying every child: server-side apply restores the fields we own)."""
    meta = body.get("metadata") or {}
    name = (meta.get("labels") or {}).get(b.INSTANCE_LABEL)
    kube: Kube | None = getattr(memo, "kube", None)
    if not name or kube is None:
        return
    namespace, kind = meta["namespace"], body.get("kind")
    role = (meta.get("labels") or {}).get(b.ROLE_LABEL)
    if role in ("leader", "worker"):
        leader = meta["name"] if role == "leader" and kind == "Pod" else (meta.get("labels") or {}).get(b.GROUP_LABEL)
        cr = kube.get_llmd(namespace, name)
        pod = kube.get("v1", "Pod", namespace, leader) if leader else None
        if cr is not None and pod is not None and not cr["metadata"].get("deletionTimestamp"):
            ensure_workers(kube, cr, pod, logger)
        if role == "worker":
            return  # the group's state shows in its leader
    if kind in ("Pod", "StatefulSet"):
        cr = kube.get_llmd(namespace, name)
        if cr is not None and not cr["metadata"].get("deletionTimestamp") and advance_rollout(kube, cr, logger):
            try:
                ensure_children(kube, cr, memo.pdb_api_version, logger)
            except kopf.TemporaryError as e:
                logger.warning(f"rollout step: {e}")  # the reconcile handler retries
            return
    if kind != "Pod":
        cr = kube.get_llmd(namespace, name)
        refs = meta.get("ownerReferences") or []
        if cr is None and kind == "PersistentVolumeClaim" and type != "DELETED" and not refs \
                and meta["name"].startswith(f"model-cache-{name}-") and not meta.get("deletionTimestamp"):
            # a per-replica claim made just before its LLMDeployment went, too late to be
            # adopted: nothing else would ever delete it
            logger.info(f"PersistentVolumeClaim {meta['name']}: LLMDeployment {name} is gone; deleting it")
            kube.delete("v1", kind, namespace, meta["name"])
            return
        if cr is None or cr["metadata"].get("deletionTimestamp"):
            return
        owner = b.Owner(name, namespace, cr["metadata"]["uid"])
        if kind == "PersistentVolumeClaim" and type != "DELETED" and not refs \
                and meta["name"].startswith(b.per_replica_claim_prefix(owner)):
            # a per-replica cache claim made by the StatefulSet controller: it goes away with
            # the LLMDeployment (StatefulSets keep their claims otherwise)
            kube.set_owner("v1", kind, namespace, meta["name"], owner.reference())
            logger.info(f"PersistentVolumeClaim {meta['name']} now belongs to LLMDeployment {name}")
            return
        if not any(r.get("uid") == cr["metadata"]["uid"] for r in refs):
            return  # not ours (a look-alike, or one left by a deleted namesake)
        why = drifted(kube, cr, kind, meta["name"], type, memo.pdb_api_version)
        if why:
            logger.info(f"{kind} {meta['name']} was {why} outside the operator; re-applying")
            try:
                ensure_children(kube, cr, memo.pdb_api_version, logger)
            except kopf.TemporaryError as e:
                logger.warning(f"re-applying after drift: {e}")  # the reconcile handler retries
            return
        if kind != "StatefulSet":
            return
    refresh_status(kube, namespace, name)


for _group, _version, _plural in [("apps", "v1", "statefulsets"), ("", "v1", "pods"), ("", "v1", "services"),
                                  ("", "v1", "persistentvolumeclaims"), ("policy", None, "poddisruptionbudgets")]:
    # a versionless selector watches the server's preferred version (policy/v1 or v1beta1)
    _args = (_group, _version, _plural) if _version else (_group, _plural)
    kopf.on.event(*_args, labels=CHILD_LABELS, registry=registry)(_child_event)


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


@kopf.daemon(*RESOURCE, registry=registry, when=_builtin_autoscaling, cancellation_timeout=5)
async def autoscale(stopped: kopf.DaemonStopped, body: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The built-in autoscaler: a loop per LLMDeployment with builtin autoscaling enabled,
    polling every spec.autoscaling.intervalSeconds (kopf stops it when autoscaling is turned
    off or the provider changes, and when the resource goes away). Its window of samples
    lives in memory: after a restart it scales up at once but waits a whole scale-down window
    before scaling down.

    An async daemon on purpose: kopf can cancel a task wherever it waits, while a sync daemon's
    thread only ends when it looks at its stop flag, and a thread that misses it keeps the
    process from exiting. Each poll's blocking calls run in a worker thread and are bounded by
    their own time limits (API requests, scrapes)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    state = asc.Autoscaler()
    while not stopped:
        try:
            delay = await asyncio.to_thread(autoscale_once, memo.kube, namespace, name, state, logger,
                                            pod_address=memo.pod_address)
        except ApiException as e:
            logger.warning(f"autoscaler: API call failed: {_api_message(e)}")
            delay = 5.0
        except Exception:  # noqa: BLE001 - one bad poll must not end the loop
            logger.exception("autoscaler: poll failed")
            delay = 5.0
        await stopped.wait(delay)
