"""A real, throw-away Kubernetes control plane on loopback for the operator's tests:
etcd + kube-apiserver + kube-controller-manager (no scheduler, no kubelet), with client
certificates made by openssl, and a kubeconfig for an admin (system:masters).

The binaries come from ``bash .ci/k8s.sh install`` (built once, cached outside the repo).
When $KUBECONFIG is set, nothing is started and that cluster is used instead.

    python tests/operator/k8s_cluster.py      # start one and wait (prints the kubeconfig)
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvship.ports import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "run `bash .ci/k8s.sh install` (as root) to build/cache them"


class ClusterUnavailable(RuntimeError):
    pass


def bindir() -> Path:
    out = subprocess.run(["bash", str(REPO / ".ci" / "k8s.sh"), "bindir"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def binaries_present() -> bool:
    d = bindir()
    return all((d / b).is_file() for b in ("etcd", "kube-apiserver", "kube-controller-manager"))


def helm_path() -> Path | None:
    p = bindir() / "helm"
    return p if p.is_file() else (Path(shutil.which("helm")) if shutil.which("helm") else None)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """CA, API server serving cert, admin client cert, service-account key pair."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "30", "-subj", "/CN=kvship-test-ca", cwd=d)
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n"
    )
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (
        ("server", "/CN=kube-apiserver", "server.ext"),
        ("admin", "/O=system:masters/CN=kvship-admin", "client.ext"),
    ):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "30", "-extfile", ext, cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig_text(server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
                    token: str | None = None, user: str = "admin", namespace: str = "default") -> str:
    user_lines = []
    if cert and key:
        user_lines += [f"    client-certificate: {cert}", f"    client-key: {key}"]
    if token:
        user_lines.append(f"    token: {token}")
    return "\n".join([
        "apiVersion: v1",
        "kind: Config",
        "clusters:",
        "- name: kvship-test",
        "  cluster:",
        f"    server: {server}",
        f"    certificate-authority: {ca}",
        "users:",
        f"- name: {user}",
        "  user:",
        *user_lines,
        "contexts:",
        "- name: kvship-test",
        "  context:",
        "    cluster: kvship-test",
        f"    user: {user}",
        f"    namespace: {namespace}",
        "current-context: kvship-test",
        "",
    ])


@dataclass
class Cluster:
    kubeconfig: Path
    workdir: Path | None = None
    server: str = ""
    ca: Path | None = None
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    started_in: float = 0.0

    @property
    def external(self) -> bool:
        return not self.procs

    def logs(self, name: str, tail: int = 40) -> str:
        if self.workdir is None:
            return ""
        p = self.workdir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-tail:]) if p.exists() else ""

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        if self.workdir is not None and not os.environ.get("KVSHIP_K8S_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)


def _start(cluster: Cluster, name: str, argv: list[str]) -> subprocess.Popen:
    assert cluster.workdir is not None
    log = open(cluster.workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    cluster.procs.append((name, proc))
    return proc


def _wait(cluster: Cluster, name: str, check, timeout: float) -> None:
    proc = dict(cluster.procs)[name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterUnavailable(f"{name} exited with {proc.returncode}:\n{cluster.logs(name)}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise ClusterUnavailable(f"{name} not ready after {timeout} s:\n{cluster.logs(name)}")


def start(timeout: float = 60.0) -> Cluster:
    """Start etcd, kube-apiserver and kube-controller-manager; return when /readyz is ok."""
    if os.environ.get("KUBECONFIG"):
        return Cluster(kubeconfig=Path(os.environ["KUBECONFIG"]))
    if not binaries_present():
        raise ClusterUnavailable(f"Kubernetes test binaries missing in {bindir()}: {INSTALL_HINT}")
    t0 = time.monotonic()
    bins = bindir()
    # etcd on tmpfs when there is room: no fsync cost
    shm = Path("/dev/shm")
    base = shm if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > (1 << 30) else None
    work = Path(tempfile.mkdtemp(prefix="kvship-k8s-", dir=base))
    cluster = Cluster(kubeconfig=work / "admin.kubeconfig", workdir=work)
    atexit.register(cluster.stop)  # also on an interrupted run
    try:
        make_certs(work)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        _start(cluster, "etcd", [
            str(bins / "etcd"), "--name", "kvship-test", "--data-dir", str(work / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"kvship-test=http://127.0.0.1:{peer_port}",
            "--listen-metrics-urls", "", "--log-level", "warn", "--logger", "zap",
            "--quota-backend-bytes", str(2 << 30), "--snapshot-count", "100000",
        ])
        _wait(cluster, "etcd", lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=1).status == 200, 20)

        cluster.server = f"https://127.0.0.1:{api_port}"
        cluster.ca = work / "ca.crt"
        _start(cluster, "kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", "--insecure-port=0",
            f"--cert-dir={work}",
            f"--tls-cert-file={work / 'server.crt'}", f"--tls-private-key-file={work / 'server.key'}",
            f"--client-ca-file={work / 'ca.crt'}",
            f"--service-account-key-file={work / 'sa.pub'}",
            f"--service-account-signing-key-file={work / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC",
            "--endpoint-reconciler-type=none",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--allow-privileged=true",
            "--watch-cache=true",
            "--profiling=false",
            "--v=1",
        ])
        ctx = ssl.create_default_context(cafile=str(work / "ca.crt"))
        ctx.load_cert_chain(str(work / "admin.crt"), str(work / "admin.key"))

        def api_ready() -> bool:
            with urllib.request.urlopen(f"{cluster.server}/readyz", context=ctx, timeout=2) as r:
                return r.status == 200

        _wait(cluster, "kube-apiserver", api_ready, timeout)
        cluster.kubeconfig.write_text(kubeconfig_text(
            cluster.server, work / "ca.crt", cert=work / "admin.crt", key=work / "admin.key"))
        _start(cluster, "kube-controller-manager", [
            str(bins / "kube-controller-manager"),
            f"--kubeconfig={cluster.kubeconfig}",
            "--port=0", "--secure-port=0",
            "--leader-elect=false",
            "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-service,-route,"
            "-attachdetach,-persistentvolume-expander,-ttl,-bootstrapsigner,-tokencleaner,-csrsigning,-csrapproving",
            f"--service-account-private-key-file={work / 'sa.key'}",
            f"--root-ca-file={work / 'ca.crt'}",
            "--use-service-account-credentials=false",
            "--concurrent-gc-syncs=5",
            "--v=1",
        ])
        time.sleep(0.5)
        if dict(cluster.procs)["kube-controller-manager"].poll() is not None:
            raise ClusterUnavailable("kube-controller-manager exited:\n" + cluster.logs("kube-controller-manager"))
        cluster.started_in = time.monotonic() - t0
        return cluster
    except BaseException:
        cluster.stop()
        raise


if __name__ == "__main__":
    c = start()
    print(f"export KUBECONFIG={c.kubeconfig}   # up in {c.started_in:.1f} s; Ctrl-C stops it", flush=True)
    os.environ["KVSHIP_K8S_KEEP"] = ""
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
        sys.exit(0)
