"""Multi-node replicas (issue #20, item 11): `spec.nodesPerReplica: N` makes each replica a
group of N pods, modelled on LeaderWorkerSet: one StatefulSet of leaders (what the Service
sends traffic to) and, per leader, a StatefulSet of N-1 workers owned by that leader pod, so a
group is created, replaced and removed with its leader.

The rendezvous runs for real: the pod specs the builders render for a leader and its worker
(command, args, env, as a kubelet would run them) start two engine processes on loopback, which
meet through the engine's cross-host environment and answer a request together."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvship_operator import builders as b
from kvship_operator import spec as s
from kvship_operator.schema import parse
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from server_utils import free_port

OWNER = b.Owner("grp", "team-a", "uid-1")


def group_spec(**extra) -> s.LLMDeploymentSpec:
    return parse(s.LLMDeploymentSpec, {
        "model": {"pvc": {"claimName": "weights", "path": "tiny"}}, "servedModelName": "tiny",
        "tensorParallelSize": 2, "nodesPerReplica": 2, "modelCache": {"enabled": False},
        "engine": {"args": ["--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64"]}, **extra})


def test_group_children():
    spec = group_spec(replicas=3)
    objs = {(o["kind"], o["metadata"]["name"]): o for o in b.build(OWNER, spec)}
    leaders = objs[("StatefulSet", "grp")]
    assert leaders["spec"]["replicas"] == 3  # groups
    tmpl = leaders["spec"]["template"]
    assert tmpl["metadata"]["labels"][b.ROLE_LABEL] == "leader"
    c = tmpl["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # tensorParallelSize / nodesPerReplica
    env = {e["name"]: e for e in c["env"]}
    assert env["KVSHIP_NNODES"]["value"] == "2" and env["KVSHIP_NODE_RANK"]["value"] == "0"
    assert env["MASTER_ADDR"]["value"] == "$(POD_NAME).grp-engines.team-a.svc"
    # only leaders get traffic
    assert objs[("Service", "grp")]["spec"]["selector"][b.ROLE_LABEL] == "leader"
    assert objs[("PodDisruptionBudget", "grp")]["spec"]["selector"]["matchLabels"][b.ROLE_LABEL] == "leader"

    leader_pod = {"metadata": {"name": "grp-1", "uid": "pod-uid", "namespace": "team-a"}}
    workers = b.worker_statefulset(OWNER, spec, leader_pod)
    assert workers["metadata"]["name"] == "grp-1-w" and workers["spec"]["replicas"] == 1
    (ref,) = workers["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("Pod", "grp-1", "pod-uid", True)
    w = workers["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in w["env"]}
    assert env["MASTER_ADDR"]["value"] == "grp-1.grp-engines.team-a.svc" and "KVSHIP_NODE_RANK" not in env
    assert "readinessProbe" not in w and w["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # worker selectors never match leaders (nor the Service's)
    assert workers["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] != "kvship-engine"
    with pytest.raises(Exception, match="multiple of nodesPerReplica"):
        parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "tensorParallelSize": 2, "nodesPerReplica": 4})


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of env values and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _process(container: dict, pod_name: str, subst: dict[str, str], home) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a container as a kubelet would start it (downward API
    metadata.name, $(VAR) expansion), with the cluster's addresses and paths replaced by
    their loopback stand-ins (``subst``)."""
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "HOSTNAME": pod_name, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for e in container.get("env") or []:
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            env[e["name"]] = pod_name
        else:
            env[e["name"]] = _expand(e["value"], env)
    for k, v in list(env.items()):
        env[k] = subst.get(v, v)
    env["HOME"] = env["TRITON_CACHE_DIR"] = env["XDG_CACHE_HOME"] = str(home)
    argv = [subst.get(a, a) for a in [*container["command"], *container["args"]]]
    return argv, env


@pytest.mark.timeout(300)
def test_group_rendezvous_from_rendered_pod_specs(tiny_models, tmp_path):
    folder = tiny_models["llama-gqa-tied"][0]
    spec = group_spec()
    leader_tmpl = b.statefulset(OWNER, spec)["spec"]["template"]["spec"]["containers"][0]
    leader_pod = {"metadata": {"name": "grp-0", "uid": "u", "namespace": "team-a"}}
    worker_tmpl = b.worker_statefulset(OWNER, spec, leader_pod)["spec"]["template"]["spec"]["containers"][0]
    http_port, store_port = free_port(), free_port()
    subst = {"grp-0.grp-engines.team-a.svc": "127.0.0.1", str(s.ENGINE_PORT): str(http_port),
             str(b.RENDEZVOUS_PORT): str(store_port), "/model-src/tiny": str(folder), "0.0.0.0": "127.0.0.1"}
    leader_argv, leader_env = _process(leader_tmpl, "grp-0", subst, tmp_path)
    worker_argv, worker_env = _process(worker_tmpl, "grp-0-w-0", subst, tmp_path)
    assert worker_argv[:2] == ["sh", "-c"] and leader_argv[0] == "kvship"
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("leader", "worker")}
    procs = {"worker": subprocess.Popen(worker_argv, env=worker_env, stdout=logs["worker"], stderr=subprocess.STDOUT),
             "leader": subprocess.Popen(leader_argv, env=leader_env, stdout=logs["leader"], stderr=subprocess.STDOUT)}

    def show() -> str:
        return "\n".join(f"--- {n}\n" + (tmp_path / f"{n}.log").read_text()[-2000:] for n in procs)

    try:
        def healthy() -> bool:
            assert all(p.poll() is None for p in procs.values()), show()
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 200, interval=0.5, what="the group serving", show=show)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert "serving ranks 1..1" in (tmp_path / "worker.log").read_text(), show()
        procs["leader"].send_signal(signal.SIGTERM)
        assert procs["leader"].wait(60) == 0, show()
        assert procs["worker"].wait(60) == 0, show()  # a worker ends with its leader
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs.values():
            f.close()


def test_groups_on_the_api_server(objects, run_operator):
    """Against the real API server: a worker StatefulSet per leader pod, owned by it (so a
    group goes with its leader: replaced leader, removed group on scale-down), and
    `kubectl get llmd` counting groups."""
    run_operator()
    objects.create_llmd("grp", {"model": {"hub": "a/b"}, "tensorParallelSize": 2, "nodesPerReplica": 2,
                                "replicas": 2})
    for g in (0, 1):
        w = wait_for(lambda g=g: objects.get("apps/v1", "statefulsets", f"grp-{g}-w"), 30, what=f"workers of group {g}")
        leader = objects.get("v1", "pods", f"grp-{g}")
        assert w["metadata"]["ownerReferences"][0]["uid"] == leader["metadata"]["uid"]
        assert w["spec"]["replicas"] == 1
    wait_for(lambda: len(objects.list("v1", "pods", "app.kubernetes.io/name=kvship-engine-worker")) == 2, 30,
             what="worker pods")
    svc = objects.get("v1", "services", "grp")
    assert svc["spec"]["selector"][b.ROLE_LABEL] == "leader"

    # scaled down by one group: the group's workers go with its leader
    objects.patch_llmd_spec("grp", {"replicas": 1})
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "grp-1-w") is None, 60, what="group 1 removed")
    # a leader replaced (a restart): its group is re-created for the new leader
    old = objects.get("apps/v1", "statefulsets", "grp-0-w")
    objects._call("DELETE", f"/api/v1/namespaces/{objects.ns}/pods/grp-0")
    new = wait_for(lambda: (x := objects.get("apps/v1", "statefulsets", "grp-0-w"))
                   and x["metadata"]["uid"] != old["metadata"]["uid"] and x, 60, what="group 0 re-created")
    assert new["metadata"]["ownerReferences"][0]["uid"] == objects.get("v1", "pods", "grp-0")["metadata"]["uid"]
    time.sleep(0.5)
