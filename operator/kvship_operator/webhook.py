"""The validating admission webhook: a spec the reconciler would refuse is refused when it is
applied, so that `kubectl apply` and GitOps tools see the refusal (the reconciler keeps its
own checks for clusters where the webhook is off). Both run validate.valid_spec.

In a cluster the chart makes the certificate and the ValidatingWebhookConfiguration, and the
operator only serves (``cert_dir``). Without the chart, ``managed`` names a configuration
that kopf creates and points at ``host`` (the tests: 127.0.0.1 with a certificate of theirs).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import kopf

from .schema import SpecError
from .validate import valid_spec

# The handler's id, which is also the path the API server posts to (/validate-llmdeployment).
HANDLER_ID = "validate-llmdeployment"


@dataclass(frozen=True)
class Webhook:
    port: int = 9443
    addr: str = "0.0.0.0"
    cert_dir: str | None = None  # tls.crt and tls.key, and ca.crt when the API server needs the CA
    host: str | None = None  # the host in the URL of a managed configuration
    managed: str | None = None  # the ValidatingWebhookConfiguration kopf keeps (None: the chart's)

    def server(self) -> kopf.WebhookServer:
        files: dict[str, Any] = {}
        if self.cert_dir:
            ca = os.path.join(self.cert_dir, "ca.crt")
            files = {"certfile": os.path.join(self.cert_dir, "tls.crt"),
                     "pkeyfile": os.path.join(self.cert_dir, "tls.key"),
                     "cafile": ca if os.path.exists(ca) else None}
        return kopf.WebhookServer(addr=self.addr, port=self.port, host=self.host, path="", **files)


async def no_server(fn: Any) -> AsyncIterator[Any]:
    """The webhook turned off: the handler stays registered and nothing listens."""
    await asyncio.Event().wait()
    yield {}  # never reached: makes this an async generator, which is what kopf iterates


def review(body: dict, old: dict | None, operation: str | None) -> None:
    """Refuse (kopf.AdmissionError, HTTP 422) a spec that valid_spec refuses, with the
    message the reconciler would put in status. An update that leaves the spec alone passes:
    an object admitted before the webhook existed stays writable (labels, status, deletion)."""
    if operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec"):
        return
    meta = dict(body.get("metadata") or {})
    # a generated name gets five characters from the server
    meta["name"] = meta.get("name") or f"{meta.get('generateName', '')}xxxxx"
    try:
        valid_spec({"metadata": meta, "spec": body.get("spec")})
    except SpecError as e:
        raise kopf.AdmissionError(f"invalid spec: {e}", code=422) from None
