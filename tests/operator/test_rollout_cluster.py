"""Rollouts that drop nothing, and status that says what serves (issue #20, items 2 and 3),
end to end: the operator against the real API server, a real `kvship serve` process (bundled
SmolLM2 on CPU) standing in for every pod, and a steady request load routed the way a
Service routes (to ready pods that are not terminating).

No kubelet runs: a test kubelet binds each pod to a node, starts its server with the
`--served-model-name` of the pod's own arguments, marks it Ready once it answers, and, for a
pod being deleted, does what the pod spec asks: keeps serving through the preStop wait while
endpoints drop the pod, then SIGTERM (the engine drains its in-flight requests), then removes
the pod. The steps that showed item 3: one replica, an `engine.args` change: the ready pod
was deleted 0.4 s later (a StatefulSet rolling update, no surge)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvship_operator import metrics_client
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from server_utils import ServerProcess
from test_operator_cluster import cond, running_ready

NAME = "roll"
NODE = "test-node"
PRESTOP = 2.0  # the pod spec says 10 s; endpoints here follow within the router's 0.2 s refresh
SERVER_ARGS = ("--max-model-len", "256", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "10")


class PodLife(threading.Thread):
    """One pod, as a kubelet would run it."""

    def __init__(self, kubelet: "Kubelet", pod: dict):
        super().__init__(daemon=True)
        self.k, self.pod = kubelet, pod
        self.name, self.uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        self.server: ServerProcess | None = None
        self.model = metrics_client.started_with(pod)
        self.error: str | None = None

    def run(self) -> None:
        o = self.k.objects
        try:
            o._call("POST", f"/api/v1/namespaces/{o.ns}/pods/{self.name}/binding",
                    {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": self.name},
                     "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}})
            args = [a for a in self.pod["spec"]["containers"][0]["args"]]
            at = args.index("--max-num-seqs") if "--max-num-seqs" in args else None
            extra = args[at:at + 2] if at is not None else []
            self.server = ServerProcess("--served-model-name", self.model, *SERVER_ARGS, *extra)
            self.server.wait_ready()
            if self._gone():
                return
            status = running_ready(self.name)
            status["podIP"] = "127.0.0.1"
            o.patch_pod_status(self.name, status)
            self.k.addresses[self.uid] = (self.server.url, self.model)
            while not self.k.stop_flag.is_set() and not self._gone():
                time.sleep(0.2)
            if self.k.stop_flag.is_set():
                return
            time.sleep(PRESTOP)  # preStop: still serving while endpoints drop the pod
            try:
                o.patch_pod_status(self.name, {"conditions": [{"type": "Ready", "status": "False"}]})
            except Exception:  # noqa: BLE001 - gone already
                pass
            self.server.stop(30)  # SIGTERM: the engine drains its in-flight requests
            self.k.stopped.append((self.name, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            self.k.addresses.pop(self.uid, None)
            if self.server is not None:
                self.server.stop(10)
            try:  # the kubelet confirms the deletion
                o._call("DELETE", f"/api/v1/namespaces/{o.ns}/pods/{self.name}",
                        {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
            except Exception:  # noqa: BLE001
                pass

    def _gone(self) -> bool:
        pod = self.k.objects.get("v1", "pods", self.name)
        return pod is None or pod["metadata"]["uid"] != self.uid or bool(pod["metadata"].get("deletionTimestamp"))


class Kubelet(threading.Thread):
    def __init__(self, objects):
        super().__init__(daemon=True)
        self.objects, self.stop_flag = objects, threading.Event()
        self.lives: dict[str, PodLife] = {}
        self.addresses: dict[str, tuple[str, str]] = {}  # pod uid -> (server url, model)
        self.stopped: list[tuple[str, float]] = []

    def run(self) -> None:
        while not self.stop_flag.wait(0.2):
            try:
                pods = self.objects.list("v1", "pods", f"kvship.io/llmdeployment={NAME}")
            except Exception:  # noqa: BLE001
                continue
            for pod in pods:
                uid = pod["metadata"]["uid"]
                if uid not in self.lives and not pod["metadata"].get("deletionTimestamp"):
                    self.lives[uid] = PodLife(self, pod)
                    self.lives[uid].start()

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(10)
        for life in self.lives.values():
            life.join(60)
        assert not any(life.is_alive() for life in self.lives.values()), "pod threads did not stop"

    def pod_address(self, pod: dict) -> str | None:
        found = self.addresses.get(pod["metadata"]["uid"])
        return found[0].removeprefix("http://") if found else None


class Load:
    """Workers sending short streamed completions to the Service's endpoints (ready pods not
    being deleted, refreshed every 0.2 s), round-robin. Every request that does not complete,
    including one that finds no endpoint, is a failure."""

    def __init__(self, objects, kubelet: Kubelet, workers: int = 3):
        self.objects, self.kubelet = objects, kubelet
        self.stop_flag = threading.Event()
        self.endpoints: list[tuple[str, str]] = []
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._router, daemon=True)]
        self.threads += [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(workers)]

    def _refresh(self) -> None:
        pods = self.objects.list("v1", "pods", f"kvship.io/llmdeployment={NAME}")
        self.endpoints = [self.kubelet.addresses[p["metadata"]["uid"]] for p in pods
                          if metrics_client.is_ready(p) and p["metadata"]["uid"] in self.kubelet.addresses]

    def _router(self) -> None:
        while not self.stop_flag.wait(0.2):
            try:
                self._refresh()
            except Exception:  # noqa: BLE001
                continue

    def _worker(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
            while not self.stop_flag.is_set():
                endpoints = list(self.endpoints)
                n += 1
                if not endpoints:
                    with self.lock:
                        self.failed.append(f"{time.monotonic():.1f}: no endpoint")
                    time.sleep(0.2)
                    continue
                url, model = endpoints[(n + i) % len(endpoints)]
                body = {"model": model, "prompt": f"Count to ten, worker {i}.", "max_tokens": 16,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                try:
                    done = False
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data: ") and '"error"' in line:
                                raise RuntimeError(line[:200])
                            done = done or line == "data: [DONE]"
                    if not done:
                        raise RuntimeError("stream ended without [DONE]")
                    with self.lock:
                        self.ok += 1
                except Exception as e:  # noqa: BLE001 - reported by the test
                    with self.lock:
                        self.failed.append(f"{time.monotonic():.1f} {url}: {e!r}"[:300])

    def start(self) -> "Load":
        self._refresh()  # the endpoints as they are now, before the first request
        assert self.endpoints, "no endpoint to send the load to"
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "load threads did not stop"


def pods_by_revision(objects) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in objects.list("v1", "pods", f"kvship.io/llmdeployment={NAME}"):
        if not p["metadata"].get("deletionTimestamp"):
            revision = p["metadata"]["labels"].get("controller-revision-hash", "?")
            out.setdefault(revision, []).append(p["metadata"]["name"])
    return out


@pytest.mark.timeout(600)
def test_one_replica_rollout_drops_nothing_and_status_says_what_serves(objects, run_operator):
    if objects.get("v1", "nodes", NODE) is None:
        try:
            objects._call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        except Exception:  # noqa: BLE001 - created by a parallel run
            pass
    kubelet = Kubelet(objects)
    kubelet.start()
    load = None
    try:
        run_operator(pod_address=kubelet.pod_address)
        objects.create_llmd(NAME, {
            "model": {"pvc": {"claimName": "models"}}, "servedModelName": "smol-a", "gpu": {"count": 0},
            "modelCache": {"enabled": False}, "replicas": 1, "engine": {"args": ["--max-num-seqs", "4"]},
            "resources": {"requests": {"cpu": "100m", "memory": "100Mi"}}, "shutdownTimeoutSeconds": 10})
        cr = wait_for(lambda: cond(c := objects.llmd(NAME), "Ready").get("reason") == "Serving" and c, 240,
                      interval=0.5, what="first replica serving", show=lambda: objects.llmd(NAME).get("status"))
        assert cr["status"]["servingModel"] == "smol-a"  # as the pod's engine reports it
        first = pods_by_revision(objects)

        # item 3: an args change under load
        load = Load(objects, kubelet).start()
        wait_for(lambda: load.ok >= 3, 60, what="load flowing", show=lambda: load.failed[:3])
        objects.patch_llmd_spec(NAME, {"engine": {"args": ["--max-num-seqs", "2"]}})
        seen_rolling = wait_for(
            lambda: cond(c := objects.llmd(NAME), "Progressing").get("reason") == "RollingOut" and c,
            30, what="Progressing=True RollingOut")
        assert cond(seen_rolling, "Ready")["status"] == "True"  # the old pod serves meanwhile

        def rolled():
            cr = objects.llmd(NAME)
            by_rev = pods_by_revision(objects)
            return (cond(cr, "Progressing").get("reason") == "Complete" and cond(cr, "Ready").get("reason") == "Serving"
                    and len(by_rev) == 1 and sum(map(len, by_rev.values())) == 1 and set(by_rev) != set(first)
                    and objects.get("apps/v1", "statefulsets", NAME)["spec"]["replicas"] == 1
                    # the surge pod has drained and gone too, under the load
                    and len(objects.list("v1", "pods", f"kvship.io/llmdeployment={NAME}")) == 1 and cr)

        cr = wait_for(rolled, 300, interval=0.5, what="rollout complete",
                      show=lambda: (objects.llmd(NAME).get("status"), pods_by_revision(objects), load.failed[:3]))
        time.sleep(1)
        load.stop()
        assert load.failed == [], load.failed[:10]
        assert load.ok > 10, load.ok
        assert len(kubelet.stopped) >= 2, kubelet.stopped  # the old pod and the surge pod drained
        assert cr["status"]["updatedReadyReplicas"] == 1 and cr["status"]["replicas"] == 1
        assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]
        wait_for(lambda: any("replaced pod" in e["message"] for e in objects.events(NAME) if e["reason"] == "Applied"),
                 30, what="an Applied event naming the replaced pod",  # events trail status (kopf's queue)
                 show=lambda: [e["message"] for e in objects.events(NAME)])

        # item 2: a model change; until the new pods serve, status says the old model serves
        objects.patch_llmd_spec(NAME, {"servedModelName": "smol-b"})
        cr = wait_for(lambda: cond(c := objects.llmd(NAME), "Progressing").get("reason") == "RollingOut" and c, 30,
                      what="rolling out the new model")
        assert cr["status"]["servedModelName"] == "smol-b"  # what clients will use...
        assert cr["status"]["servingModel"] == "smol-a"  # ...and what serves now
        assert cond(cr, "Ready")["reason"] == "ServingPreviousSpec" and "smol-a" in cond(cr, "Ready")["message"]
        wait_for(lambda: (c := objects.llmd(NAME))["status"].get("servingModel") == "smol-b"
                 and cond(c, "Progressing").get("reason") == "Complete", 300, interval=0.5,
                 what="the new model serving", show=lambda: objects.llmd(NAME).get("status"))
    finally:
        if load is not None:
            load.stop()
        kubelet.stop()
    assert not [life.error for life in kubelet.lives.values() if life.error]
