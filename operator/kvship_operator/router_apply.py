"""Routing on the cluster, beyond the children every reconcile applies: the InferencePool of
mode gateway, made only where the Gateway API Inference Extension's CRD is installed, and the
router's children deleted when routing turns off or changes mode (only those this
LLMDeployment owns). Failures are reported, not retried: the replicas serve either way."""
from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import builders as b
from . import router_builders as rb
from . import spec as s
from .apply import api_message, apply_reported, owned_by
from .kube import Kube


def _delete_owned(kube: Kube, owner: b.Owner, api_version: str, kind: str, name: str) -> list[str]:
    if owned_by(kube.get(api_version, kind, owner.namespace, name), owner):
        kube.delete(api_version, kind, owner.namespace, name)
        return [f"deleted {kind} {name}"]
    return []


def ensure_routing(kube: Kube, cr: Any, owner: b.Owner, spec: s.LLMDeploymentSpec,
                   logger: logging.Logger) -> list[str]:
    changes: list[str] = []
    pool_crd = kube.has_crd(rb.INFERENCE_POOL_CRD)
    try:
        if not rb.routed(spec):
            for api_version, kind, name in rb.ROUTER_KINDS:
                changes += _delete_owned(kube, owner, api_version, kind, name(owner))
        if spec.routing.mode != "gateway":
            if pool_crd:
                changes += _delete_owned(kube, owner, rb.INFERENCE_POOL_API_VERSION, "InferencePool", owner.name)
            return changes
        if not pool_crd:
            message = (f"routing.mode is gateway but the InferencePool CRD {rb.INFERENCE_POOL_CRD} is not installed; "
                       f"the endpoint picker runs (Service {rb.router_name(owner)}, port {rb.PICKER_PORT}) without "
                       "an InferencePool (install the Gateway API Inference Extension CRDs, or the chart with "
                       "gatewayApiInferenceExtension.installCRD=true)")
            logger.warning(message)
            kopf.warn(cr, reason="InferencePoolCRDMissing", message=message)
            return changes
        changes += apply_reported(kube, rb.inference_pool(owner, spec))
    except ApiException as e:
        message = f"routing objects of {owner.name}: {api_message(e)}"
        logger.warning(message)
        kopf.warn(cr, reason="RoutingFailed", message=message)
    return changes
