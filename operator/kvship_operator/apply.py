"""Server-side apply of an LLMDeployment's children: each child on its own, skipped when the
object applied last time is unchanged and still in place, claims changed only where Kubernetes
lets them."""
from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import builders as b
from . import router_builders as rb
from . import spec as s
from .kube import Kube

APPLIED_ANNOTATION = "kvship.io/applied"


def contains(actual: Any, desired: Any) -> bool:
    """Whether every field of ``desired`` has the same value in ``actual``."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(map(contains, actual, desired))
    return actual == desired or str(actual) == str(desired)


def owned_by(obj: dict | None, owner: b.Owner) -> bool:
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == owner.uid for r in refs)


def apply_reported(kube: Kube, obj: dict) -> list[str]:
    """Server-side apply one object; what changed, as the Applied event says it."""
    meta = obj["metadata"]
    before = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    after = kube.apply(obj)
    if before is None:
        return [f"created {obj['kind']} {meta['name']}"]
    if before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
        return [f"updated {obj['kind']} {meta['name']}"]
    return []


def api_message(e: ApiException) -> str:
    """The server's own message for a refused request."""
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except Exception:
        return f"{e.status} {e.reason}"


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


def applied_digest(obj: dict) -> str:
    """A digest of what the operator applies to a child, kept on it: a child that still holds
    every field of the same applied object needs no write. (Applying an unchanged object is
    not always free: a 1.20 server rewrites a StatefulSet with volumeClaimTemplates on every
    server-side apply.) A changed spec changes the digest, so fields no longer wanted are
    still removed by the apply."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def apply_children(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec, pdb_api_version: str,
                   logger: logging.Logger, replicas: int | None = None) -> tuple[list[str], dict[str, str], bool]:
    """Server-side apply every child, each on its own: one refused child never keeps the
    others from their update. Returns (changes, {"Kind name": error}, namespace_terminating)."""
    changes: list[str] = []
    errors: dict[str, str] = {}
    for obj in rb.children(owner, parsed, pdb_api_version=pdb_api_version, replicas=replicas):
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
            detail = api_message(e)
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


def ensure_workers(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec, leader_pod: dict,
                   logger: logging.Logger) -> None:
    """A multi-node group's workers: a StatefulSet per leader pod, owned by it. Made once per
    leader (a new leader, after a rollout or a restart of its group, gets a new one built
    from the spec then); one still owned by a previous leader is left to garbage collection,
    and its deletion brings us back here."""
    meta = leader_pod["metadata"]
    if not b.multi_node(parsed) or meta.get("deletionTimestamp"):
        return
    wanted = b.worker_statefulset(owner, parsed, leader_pod)
    if kube.get("apps/v1", "StatefulSet", owner.namespace, wanted["metadata"]["name"]) is not None:
        return
    kube.apply(wanted)
    logger.info(f"created StatefulSet {wanted['metadata']['name']} (the workers of {meta['name']})")
