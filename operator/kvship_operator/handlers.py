"""kopf handlers: thin glue between events and the modules that do the work (validate,
apply, rollout, drift, autoscale, status).

The registry is explicit (``registry``) so that tests and ``main`` run exactly these
handlers. The ``memo`` given to ``kopf.operator`` (see main.operate) carries ``kubeconfig`` (a path, or
None for in-cluster or $KUBECONFIG) and ``pod_address`` (where the autoscaler scrapes a pod).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import adapter_sync, adapters, apply, drift, metrics_client, rollout, router_apply, tracing, webhook
from . import autoscale as autoscaling
from . import autoscaler as asc
from . import builders as b
from . import router_builders as rb
from . import spec as s
from . import status as st
from .kube import Kube, bearer_token
from .schema import SpecError
from .validate import valid_spec

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
    # Events are auxiliary, and a stopping operator waits for kopf's retries of a failed one:
    # an event posted to a namespace being deleted (403, which no retry mends) held up a stop.
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
        router = kube.get("apps/v1", "Deployment", namespace, rb.router_name(owner)) if rb.routed(parsed) else None
        new = st.compute(owner, parsed, sts=sts, pods=pods, previous=previous, observed_generation=observed,
                         apply_errors=apply_errors, served=served, router=router)
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


def _valid(cr: dict) -> tuple[b.Owner, s.LLMDeploymentSpec] | None:
    """The owner and parsed spec of ``cr``; None for an invalid spec (the reconcile handler
    reports it)."""
    try:
        parsed = valid_spec(cr)
    except SpecError:
        return None
    return b.Owner(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["metadata"]["uid"]), parsed


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
    with rollout.lock(namespace, name):
        step = rollout.current_plan(kube, owner, parsed)
        changes, errors, terminating = apply.apply_children(kube, owner, parsed, pdb_api_version, logger,
                                                            step.replicas)
        if terminating:
            return False
        changes += rollout.replace_pods(kube, owner, step, logger)
    changes += autoscaling.ensure_autoscaling_object(kube, cr, owner, parsed, logger)
    changes += router_apply.ensure_routing(kube, cr, owner, parsed, logger)
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
        raise kopf.TemporaryError(message, delay=apply.backoff(retry))
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


@kopf.on.validate(*RESOURCE, id=webhook.HANDLER_ID, operations=["CREATE", "UPDATE"], ignore_failures=True,
                  registry=registry)
def admit(body: Any, old: Any, operation: str | None = None, **_: Any) -> None:
    """The admission webhook: the reconciler's checks, before the object is stored."""
    webhook.review(dict(body), dict(old) if old is not None else None, operation)


def _live(cr: dict | None) -> bool:
    return cr is not None and not cr["metadata"].get("deletionTimestamp")


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
        valid = _valid(cr) if _live(cr) and pod is not None else None
        if valid:
            apply.ensure_workers(kube, *valid, pod, logger)
        if role == "worker":
            return  # the group's state shows in its leader
    if kind in ("Pod", "StatefulSet"):
        cr = kube.get_llmd(namespace, name)
        valid = _valid(cr) if _live(cr) else None
        if valid and rollout.has_step(kube, *valid):
            try:
                ensure_children(kube, cr, memo.pdb_api_version, logger)
            except kopf.TemporaryError as e:
                logger.warning(f"rollout step: {e}")  # the reconcile handler retries
            return
    if kind != "Pod":
        cr = kube.get_llmd(namespace, name)
        if kind == "PersistentVolumeClaim" and drift.tend_claim(kube, meta, cr, name, type, logger):
            return
        if not _live(cr):
            return
        if not any(r.get("uid") == cr["metadata"]["uid"] for r in meta.get("ownerReferences") or []):
            return  # not ours (a look-alike, or one left by a deleted namesake)
        valid = _valid(cr)
        if valid is None:
            return  # the reconcile handler reports it
        owner, parsed = valid
        replicas = rollout.current_plan(kube, owner, parsed).replicas if kind == "StatefulSet" else None
        why = drift.drifted(kube, owner, parsed, kind, meta["name"], type, memo.pdb_api_version, replicas)
        if why:
            logger.info(f"{kind} {meta['name']} was {why} outside the operator; re-applying")
            try:
                ensure_children(kube, cr, memo.pdb_api_version, logger)
            except kopf.TemporaryError as e:
                logger.warning(f"re-applying after drift: {e}")  # the reconcile handler retries
            return
        if kind not in ("StatefulSet", "Deployment"):
            return
    refresh_status(kube, namespace, name)


for _group, _version, _plural in [("apps", "v1", "statefulsets"), ("apps", "v1", "deployments"),
                                  ("", "v1", "pods"), ("", "v1", "services"),
                                  ("", "v1", "persistentvolumeclaims"), ("policy", None, "poddisruptionbudgets")]:
    # a versionless selector watches the server's preferred version (policy/v1 or v1beta1)
    _args = (_group, _version, _plural) if _version else (_group, _plural)
    kopf.on.event(*_args, labels=CHILD_LABELS, registry=registry)(_child_event)


@kopf.daemon(*RESOURCE, registry=registry, when=autoscaling.builtin_enabled, cancellation_timeout=5)
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
            delay = await asyncio.to_thread(autoscaling.autoscale_once, memo.kube, namespace, name, state, logger,
                                            pod_address=memo.pod_address)
        except ApiException as e:
            logger.warning(f"autoscaler: API call failed: {apply.api_message(e)}")
            delay = 5.0
        except Exception:  # noqa: BLE001 - one bad poll must not end the loop
            logger.exception("autoscaler: poll failed")
            delay = 5.0
        await stopped.wait(delay)


def _has_adapters(spec: Any, status: Any, **_: Any) -> bool:
    # while replicas still report adapters, the last one removed is unloaded too
    return bool((spec or {}).get("adapters")) or any(r.get("adapters") for r in (status or {}).get("adapters") or [])


@kopf.timer(*RESOURCE, registry=registry, interval=15, when=_has_adapters)
def sync_adapters(body: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """spec.adapters into the running replicas (load / unload, no restart); status.adapters."""
    cr = dict(body)
    valid = _valid(cr)
    if valid is None:
        return  # the reconcile handler reports it
    owner, parsed = valid
    kube: Kube = memo.kube
    pods = [p for p in kube.list_pods(owner.namespace, b.selector_string(owner))
            if (p["metadata"].get("labels") or {}).get(b.ROLE_LABEL) != "worker"]
    held = adapter_sync.sync(pods, adapters.desired(parsed), kube.pod_address)
    if not parsed.adapters and not any(r["adapters"] for r in held):
        held = []  # all unloaded: nothing left to report
    for replica in held:
        if replica.get("message"):
            logger.warning(f"adapters of {replica['replica']}: {replica['message']}")
    if (cr.get("status") or {}).get("adapters") != held:
        kube.patch_llmd_status(owner.namespace, owner.name, {"adapters": held})
