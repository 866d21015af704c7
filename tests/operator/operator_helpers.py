"""Helpers shared by the operator tests (kept out of conftest.py so that test modules can
import them by a unique module name)."""
from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import yaml
from kubernetes.client import ApiClient, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

import k8s_cluster
from kvship_operator import main
from kvship_operator import spec as s
from kvship_operator.kube import request

REPO = k8s_cluster.REPO


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, what: str = "condition",
             show: Callable[[], Any] | None = None) -> Any:
    """Poll until predicate() returns something truthy; ApiExceptions count as not yet. On a
    time-out the message says what was awaited and, with ``show``, what was seen instead."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ApiException as e:
            last_exc = e
        time.sleep(interval)
    message = f"timed out after {timeout} s waiting for {what}"
    if last_exc:
        message += f" (last error: {last_exc})"
    if show is not None:
        try:
            message += f"; seen: {str(show())[:3000]}"
        except Exception as e:  # diagnostics only
            message += f"; (could not show state: {e!r})"
    raise AssertionError(message)


class OperatorThread:
    """The operator as `kvship-operator` runs it (kvship_operator.main.operate), in a thread,
    with its own credentials. stop() returns once the operator has ended (main.operate waits
    for the threads it started), and fails otherwise."""

    def __init__(self, kubeconfig: Path | str, *, namespaces: list[str] | None = None,
                 pod_address: Callable[[dict], str | None] | None = None, webhook: Any = None):
        self.kubeconfig = str(kubeconfig)
        self.namespaces = namespaces or []
        self.extra: dict[str, Any] = {"pod_address": pod_address} if pod_address else {}
        if webhook is not None:
            self.extra["webhook"] = webhook
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"{main.THREAD_PREFIX}-loop", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(main.operate(namespaces=self.namespaces, kubeconfig=self.kubeconfig,
                                     stop_flag=self.stop_flag, ready_flag=self.ready_flag, **self.extra))
        except BaseException as e:  # reported by stop()
            self.error = e

    def start(self, timeout: float = 30) -> "OperatorThread":
        self.thread.start()
        if not self.ready_flag.wait(timeout):
            raise AssertionError(f"operator not ready in {timeout} s (error: {self.error!r})")
        return self

    def stop(self, timeout: float = 30) -> None:
        self.stop_flag.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "operator thread did not stop:\n" + thread_stacks()


def assert_no_operator_threads() -> None:
    left = operator_threads()
    assert not left, f"operator threads still alive after every operator stopped: {left}\n" + thread_stacks()


def operator_threads() -> list[str]:
    """Names of the live threads an operator started (they all carry main.THREAD_PREFIX)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(main.THREAD_PREFIX) and t.is_alive()]


def thread_stacks() -> str:
    """Every thread's current stack, for a failure message."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        out.append(f"--- {t.name} (daemon={t.daemon})")
        if t.ident in frames:
            out.append("".join(traceback.format_stack(frames[t.ident])))
    return "\n".join(out)


class Objects:
    def __init__(self, api: ApiClient, namespace: str):
        self.api = api
        self.ns = namespace
        self.co = CustomObjectsApi(api)

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return request(self.api, method, path, body=body, content_type=content_type)

    def get(self, api_version: str, plural: str, name: str) -> dict | None:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            return self._call("GET", f"{base}/namespaces/{self.ns}/{plural}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, selector: str = "") -> list[dict]:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        q = f"?labelSelector={selector}" if selector else ""
        return self._call("GET", f"{base}/namespaces/{self.ns}/{plural}{q}")["items"]

    def create_llmd(self, name: str, spec: dict) -> dict:
        body = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": name}, "spec": spec}
        return self.co.create_namespaced_custom_object(s.GROUP, s.VERSION, self.ns, s.PLURAL, body)

    def llmd(self, name: str) -> dict | None:
        return self.get(s.API_VERSION, s.PLURAL, name)

    def patch_llmd_spec(self, name: str, spec_patch: dict) -> dict:
        return self._call("PATCH", f"/apis/{s.API_VERSION}/namespaces/{self.ns}/{s.PLURAL}/{name}",
                          {"spec": spec_patch}, "application/merge-patch+json")

    def delete_llmd(self, name: str) -> None:
        self.co.delete_namespaced_custom_object(s.GROUP, s.VERSION, self.ns, s.PLURAL, name)

    def patch_pod_status(self, name: str, status: dict) -> dict:
        return self._call("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": status},
                          "application/merge-patch+json")

    def events(self, involved: str) -> list[dict]:
        items = self._call("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e for e in items if e["involvedObject"].get("name") == involved]


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
