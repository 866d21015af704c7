"""Children changed behind the operator's back: which no longer match what the spec builds,
and the per-replica cache claims the StatefulSet controller makes, which the operator adopts
(or deletes, when their LLMDeployment is already gone)."""
from __future__ import annotations

import logging

from . import builders as b
from . import router_builders as rb
from . import spec as s
from .apply import claim_change_refused, contains
from .kube import Kube


def drifted(kube: Kube, owner: b.Owner, parsed: s.LLMDeploymentSpec, kind: str, child: str,
            event_type: str | None, pdb_api_version: str, replicas: int | None = None) -> str | None:
    """Why the child ``kind``/``child`` no longer matches what the spec builds (None: it
    does, or it is not a child the spec builds). ``replicas``: what the StatefulSet's
    replicas should be now (the rollout's step)."""
    wanted = next((o for o in rb.children(owner, parsed, pdb_api_version=pdb_api_version, replicas=replicas)
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


def tend_claim(kube: Kube, meta: dict, cr: dict | None, instance: str, event_type: str | None,
               logger: logging.Logger) -> bool:
    """Adopt or delete a per-replica cache claim of LLMDeployment ``instance`` that the
    StatefulSet controller made (it has no owner); True when ``meta`` was such a claim."""
    if event_type == "DELETED" or meta.get("ownerReferences"):
        return False
    namespace, claim = meta["namespace"], meta["name"]
    if cr is None:
        if not claim.startswith(f"model-cache-{instance}-") or meta.get("deletionTimestamp"):
            return False
        # made just before its LLMDeployment went, too late to be adopted: nothing else
        # would ever delete it
        logger.info(f"PersistentVolumeClaim {claim}: LLMDeployment {instance} is gone; deleting it")
        kube.delete("v1", "PersistentVolumeClaim", namespace, claim)
        return True
    owner = b.Owner(instance, namespace, cr["metadata"]["uid"])
    if cr["metadata"].get("deletionTimestamp") or not claim.startswith(b.per_replica_claim_prefix(owner)):
        return False
    # StatefulSets keep their claims: owned by the LLMDeployment, it goes away with it
    kube.set_owner("v1", "PersistentVolumeClaim", namespace, claim, owner.reference())
    logger.info(f"PersistentVolumeClaim {claim} now belongs to LLMDeployment {instance}")
    return True
