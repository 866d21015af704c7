"""The built-in autoscaler end to end: the operator against the real API server, real
`kvship serve` processes (bundled SmolLM2 on CPU, two sequences per batch so requests
queue) standing in for the pods through the operator's pod-address resolver, and a real load
generator. Load -> replicas rise to the maximum; load stops -> replicas fall to the
minimum only after the scale-down window; the bounds hold throughout.

The load is a fixed number of requests in flight, not a request rate: each worker keeps one
long streamed completion open and opens the next as soon as one ends, and stopping closes the
streams (the servers abort them). So the queue depth the autoscaler sees is the number of
workers however fast or slow the machine is, and the scale-down window is measured from the
autoscaler's own last high recommendation, read from its status.

No kubelet runs: the StatefulSet controller creates pod objects and this test marks them
Ready, as the other operator tests do."""
from __future__ import annotations

import threading
import time

import httpx
import kopf
import pytest

from kvship_operator import handlers, metrics_client, tracing
from operator_fixtures import (  # noqa: F401 - pytest finds fixtures by name in the module
    api,
    cluster,
    crd_installed,
    namespace,
    objects,
    run_operator,
)
from operator_helpers import assert_no_operator_threads, operator_threads, wait_for
from server_utils import start_server
from test_operator_cluster import running_ready

NAME = "smol"
MIN, MAX, TARGET = 1, 3, 2
DOWN_WINDOW = 20
INTERVAL = 2
WORKERS = 8  # requests in flight: 8 / TARGET = 4 replicas wanted, MAX caps it at 3
MAX_REQUESTS = 400  # hard bound on the load generator, whatever happens


class Kubelet(threading.Thread):
    """Marks every pod of the LLMDeployment Ready as soon as it exists."""

    def __init__(self, objects):
        super().__init__(daemon=True)
        self.objects, self.stop_flag = objects, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.3):
            try:
                for pod in self.objects.list("v1", "pods", f"kvship.io/llmdeployment={NAME}"):
                    name = pod["metadata"]["name"]
                    if not metrics_client.is_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                        self.objects.patch_pod_status(name, running_ready(name))
            except Exception:  # noqa: BLE001 - pods come and go
                pass


class Watcher(threading.Thread):
    """Records spec.replicas and the autoscaler's recommendation over time."""

    def __init__(self, objects):
        super().__init__(daemon=True)
        self.objects, self.stop_flag = objects, threading.Event()
        self.history: list[tuple[float, int]] = []  # (time, spec.replicas) at each change
        self.recommended: list[tuple[float, int]] = []  # (time, status recommendedReplicas) at each change

    def run(self) -> None:
        while not self.stop_flag.wait(0.25):
            try:
                cr = self.objects.llmd(NAME)
            except Exception:
                continue
            now = time.monotonic()
            r = cr["spec"]["replicas"]
            if not self.history or self.history[-1][1] != r:
                self.history.append((now, r))
            rec = ((cr.get("status") or {}).get("autoscaling") or {}).get("recommendedReplicas")
            if rec is not None and (not self.recommended or self.recommended[-1][1] != rec):
                self.recommended.append((now, rec))

    def replicas(self) -> int:
        return self.history[-1][1] if self.history else -1


class Load:
    """WORKERS threads, each keeping one long streamed completion open against its own server
    (worker i -> server i mod n: every server holds WORKERS / n requests at all times) and
    opening the next when one ends, until stopped or MAX_REQUESTS were sent. stop() closes the
    open streams."""

    def __init__(self, urls: list[str]):
        self.urls, self.stop_flag = urls, threading.Event()
        self.sent = self.ok = self.cut = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(WORKERS)]

    def _worker(self, i: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            while not self.stop_flag.is_set():
                with self.lock:
                    if self.sent >= MAX_REQUESTS:
                        return
                    self.sent += 1
                # A fixed server per worker: choosing by a shared counter sent every request of a
                # run to one server when the workers took turns in order ((k + 1) + k is odd),
                # and the autoscaler, scraping the other one, saw no load.
                url = self.urls[i % len(self.urls)]
                try:
                    body = {"model": "smol", "prompt": f"Write a long story about the number {i}.",
                            "max_tokens": 200, "temperature": 0.8, "ignore_eos": True, "stream": True}
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if self.stop_flag.is_set():  # leaving the block closes the stream
                                with self.lock:
                                    self.cut += 1
                                break
                            if line == "data: [DONE]":
                                with self.lock:
                                    self.ok += 1
                except Exception as e:  # noqa: BLE001 - reported by the test
                    with self.lock:
                        self.errors.append(repr(e))

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "load threads did not stop"


@pytest.fixture(scope="module")
def servers():
    args = ("--served-model-name", "smol", "--max-num-seqs", "2", "--max-model-len", "256",
            "--kv-cache-memory", "256MiB", "--shutdown-timeout", "5")
    started = []
    try:
        # started one after the other: two model loads at once on two cores only slow both
        for _ in range(2):
            started.append(start_server(*args))
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.mark.timeout(900)
def test_builtin_autoscaler_follows_load(objects, run_operator, servers):
    t0 = time.monotonic()
    # pod -> the loopback server standing in for it (the third pod has none: scraping it
    # fails, and it is left out of the load)
    stand_ins = {f"{NAME}-{i}": f"127.0.0.1:{srv.port}" for i, srv in enumerate(servers)}

    def pod_address(pod: dict) -> str | None:
        return stand_ins.get(pod["metadata"]["name"]) if pod["metadata"]["namespace"] == objects.ns else None

    kubelet, watcher = Kubelet(objects), Watcher(objects)
    kubelet.start()
    run_operator(pod_address=pod_address)
    objects.create_llmd(NAME, {
        "model": {"pvc": {"claimName": "models"}},
        "servedModelName": "smol",
        "gpu": {"count": 0},
        "modelCache": {"enabled": False},
        "replicas": 1,
        "startupTimeoutSeconds": 60,
        "autoscaling": {"enabled": True, "provider": "builtin", "minReplicas": MIN, "maxReplicas": MAX,
                        "targetRequestsPerReplica": TARGET, "scaleDownStabilizationSeconds": DOWN_WINDOW,
                        "intervalSeconds": INTERVAL},
    })
    watcher.start()
    load = None
    try:
        # idle: the autoscaler reports, and keeps the minimum
        st = wait_for(lambda: ((objects.llmd(NAME).get("status") or {}).get("autoscaling") or {}).get("observedLoad")
                      is not None and objects.llmd(NAME)["status"]["autoscaling"], 30, what="autoscaler status")
        assert st["provider"] == "builtin" and st["desiredReplicas"] == MIN, st

        load = Load([s.url for s in servers]).start()
        t_load = time.monotonic()
        wait_for(lambda: watcher.replicas() == MAX, 150, interval=0.5, what=f"replicas rising to {MAX}",
                 show=lambda: (watcher.history, objects.llmd(NAME)["status"].get("autoscaling"),
                               f"load sent {load.sent}, ok {load.ok}, errors {load.errors[:3]}",
                               [s.metrics().get("kvship:num_requests_running") for s in servers]))
        t_up = time.monotonic()
        wait_for(lambda: objects.get("apps/v1", "statefulsets", NAME)["spec"]["replicas"] == MAX, 20,
                 what="StatefulSet follows")
        time.sleep(4)  # load still there: no more than the maximum, and no scale-down
        assert watcher.replicas() == MAX
        t_stop = time.monotonic()  # the streams are closed now: the queues empty at once
        load.stop()
        t_drained = time.monotonic()
        assert load.sent > 0 and not load.errors, load.errors[:3]

        wait_for(lambda: watcher.replicas() == MIN, DOWN_WINDOW + 60, interval=0.5, what=f"replicas falling to {MIN}",
                 show=lambda: (watcher.history, objects.llmd(NAME)["status"].get("autoscaling")))
        t_down = time.monotonic()
        time.sleep(2 * INTERVAL)  # and it stays there
        assert watcher.replicas() == MIN
    finally:
        if load is not None:
            load.stop()
        for t in (watcher, kubelet):
            t.stop_flag.set()
            t.join(10)

    history = watcher.history
    values = [r for _, r in history]
    assert all(MIN <= r <= MAX for r in values), history
    # up: rising only, then down: falling only (no flapping)
    peak = values.index(MAX)
    assert values[:peak + 1] == sorted(values[:peak + 1]) and values[peak:] == sorted(values[peak:], reverse=True), history
    first_down = next(t for t, r in history[peak:] if r < MAX)
    # the scale-down waited for the window after the autoscaler last recommended the maximum.
    # That recommendation stood until the status first showed a lower one; allow two polls for
    # the poll it was made in and for slow polls on a loaded machine (without the window the
    # scale-down would follow within one poll).
    rec_peak = max(i for i, (_, r) in enumerate(watcher.recommended) if r == MAX)
    assert rec_peak + 1 < len(watcher.recommended), watcher.recommended
    t_rec_fell = watcher.recommended[rec_peak + 1][0]
    assert first_down - t_rec_fell >= DOWN_WINDOW - 2 * INTERVAL, (first_down - t_rec_fell, watcher.recommended, history)

    cr = objects.llmd(NAME)
    st = cr["status"]["autoscaling"]
    assert st["desiredReplicas"] == MIN and st["lastScaleTime"] and st["reason"] in ("Steady", "Stabilizing")
    wait_for(lambda: {"ScaledUp", "ScaledDown"} <= {e["reason"] for e in objects.events(NAME)}, 30,
             what="ScaledUp and ScaledDown events", show=lambda: [e["reason"] for e in objects.events(NAME)])
    print(f"\n[autoscaling] load sent {load.sent} requests ({load.ok} done, {load.cut} cut at the end); up to {MAX} after {t_up - t_load:.1f} s, "
          f"first scale-down {first_down - t_stop:.1f} s and down to {MIN} {t_down - t_stop:.1f} s after the load "
          f"stopped (in-flight requests done after {t_drained - t_stop:.1f} s; window {DOWN_WINDOW} s); "
          f"history {[(round(t - t0, 1), r) for t, r in history]}; "
          f"recommended {[(round(t - t0, 1), r) for t, r in watcher.recommended]}; total {time.monotonic() - t0:.1f} s")


def test_operator_stop_ends_every_thread_it_started(objects, run_operator):
    """With the built-in autoscaler's loop running (between two polls), stopping the operator
    ends promptly, and no thread the operator started is left (the fixture's teardown checks
    the same after every operator test)."""
    op = run_operator()
    objects.create_llmd("quiet", {
        "model": {"hub": "a/b"}, "replicas": 1,
        "autoscaling": {"enabled": True, "provider": "builtin", "minReplicas": 1, "maxReplicas": 2,
                        "intervalSeconds": 30}})
    wait_for(lambda: ((objects.llmd("quiet").get("status") or {}).get("autoscaling") or {}).get("reason"), 30,
             what="the autoscaler's first poll")
    assert operator_threads(), "the operator runs threads of its own (named with its prefix)"
    t = time.monotonic()
    op.stop()
    assert time.monotonic() - t < 15, f"stopping took {time.monotonic() - t:.1f} s"
    assert_no_operator_threads()


def test_event_retries_end_before_a_stop_must():
    """A stopping operator waits for the events it is still posting, and one the API server
    refuses is retried over its whole series: kopf's own (1.45) ran 54 s. CI hit it when an
    operator took up the object of the test before, whose namespace was being deleted (403,
    NamespaceTerminating, on every retry): its stop waited past 30 s. The operator's series
    must end well within the 15 s the stop test above allows."""
    settings = kopf.OperatorSettings()
    try:
        handlers.configure(settings)
    finally:
        tracing.shutdown()
    assert sum(kopf.OperatorSettings().posting.default_backoffs) > 15, "kopf's default: what this guards against"
    assert sum(settings.posting.default_backoffs) <= 10, settings.posting.default_backoffs


def test_hpa_and_keda_providers(objects, run_operator):
    """provider hpa: an HPA on the CR's scale subresource; keda without KEDA installed: a
    Warning event and no object; back to builtin: the HPA is deleted."""
    run_operator()
    hpa_version = "autoscaling/v2" if _has_api(objects, "autoscaling/v2") else "autoscaling/v2beta2"
    auto = {"enabled": True, "provider": "hpa", "minReplicas": 1, "maxReplicas": 4, "targetRequestsPerReplica": 6}
    objects.create_llmd("h", {"model": {"hub": "a/b"}, "replicas": 1, "autoscaling": auto})
    hpa = wait_for(lambda: objects.get(hpa_version, "horizontalpodautoscalers", "h"), 30, what="HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "kvship.io/v1alpha1", "kind": "LLMDeployment", "name": "h"}
    assert hpa["spec"]["maxReplicas"] == 4 and hpa["spec"]["metrics"][0]["type"] == "Pods"

    objects.patch_llmd_spec("h", {"autoscaling": {"provider": "keda", "prometheusServerAddress": "http://prom:9090"}})
    wait_for(lambda: any(e["reason"] == "KEDANotInstalled" and e["type"] == "Warning" for e in objects.events("h")), 30,
             what="KEDANotInstalled warning")
    wait_for(lambda: objects.get(hpa_version, "horizontalpodautoscalers", "h") is None, 30, what="HPA deleted")

    objects.patch_llmd_spec("h", {"autoscaling": {"provider": "hpa"}})
    wait_for(lambda: objects.get(hpa_version, "horizontalpodautoscalers", "h"), 30, what="HPA again")
    objects.patch_llmd_spec("h", {"autoscaling": {"provider": "builtin"}})
    wait_for(lambda: objects.get(hpa_version, "horizontalpodautoscalers", "h") is None, 30, what="HPA deleted again")


def _has_api(objects, group_version: str) -> bool:
    try:
        objects._call("GET", f"/apis/{group_version}")
        return True
    except Exception:
        return False
