"""The fetch-model init step, against a real HTTP server on loopback."""
from __future__ import annotations

import http.server
import io
import tarfile
import threading
import time

import pytest

from kvship_operator import fetch


class Url(str):
    requests: list[str]


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    (root / "model.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("config.json", b"{}"), ("model.safetensors", b"x" * 100)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    (root / "model.tar.gz").write_bytes(buf.getvalue())
    (root / "broken.tar.gz").write_bytes(b"not an archive")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def do_GET(self):
            requests.append(self.path)
            if self.path.startswith("/slow/"):  # a download that takes a while
                time.sleep(1.0)
                self.path = self.path[len("/slow"):]
            super().do_GET()

        def log_message(self, *a):
            pass

    requests: list[str] = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    url = Url(f"http://127.0.0.1:{httpd.server_address[1]}")
    url.requests = requests  # paths asked for, in order
    yield url
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def termlog(tmp_path, monkeypatch):
    p = tmp_path / "termination-log"
    monkeypatch.setattr(fetch, "TERMINATION_LOG", str(p))
    return p


def test_file_download_is_idempotent(server, tmp_path, termlog):
    dest = tmp_path / "cache" / "url" / "abc" / "model.gguf"
    assert fetch.main(["--url", f"{server}/model.gguf", "--dest", str(dest), "--timeout", "30"]) == 0
    assert dest.read_bytes().startswith(b"GGUF")
    dest.write_bytes(b"kept")  # a second run sees the marker and does not download again
    assert fetch.main(["--url", f"{server}/model.gguf", "--dest", str(dest), "--timeout", "30"]) == 0
    assert dest.read_bytes() == b"kept"
    assert not termlog.exists()


def test_archive_is_unpacked(server, tmp_path, termlog):
    dest = tmp_path / "cache" / "url" / "def"
    assert fetch.main(["--url", f"{server}/model.tar.gz", "--dest", str(dest)]) == 0
    assert (dest / "config.json").read_bytes() == b"{}"
    assert (dest / fetch.MARKER).exists()
    assert not list(dest.glob(".part-*"))


def test_failures_are_reported_clearly(server, tmp_path, termlog, capsys):
    dest = tmp_path / "cache" / "x"
    assert fetch.main(["--url", f"{server}/missing.bin", "--dest", str(dest / "missing.bin")]) == 1
    assert "404" in termlog.read_text() and "missing.bin" in termlog.read_text()
    assert fetch.main(["--url", f"{server}/broken.tar.gz", "--dest", str(dest)]) == 1
    assert "not a valid .tar.gz archive" in termlog.read_text()
    assert not (dest / fetch.MARKER).exists()


def test_timeout(tmp_path, termlog, monkeypatch):
    import time

    monkeypatch.setattr(fetch, "fetch_url", lambda url, dest: time.sleep(5))
    t0 = time.monotonic()
    assert fetch.main(["--url", "http://127.0.0.1:9/x", "--dest", str(tmp_path / "x"), "--timeout", "1"]) == 1
    assert time.monotonic() - t0 < 4
    assert "did not finish within 1 s" in termlog.read_text()


def test_replicas_sharing_a_cache_download_once(server, tmp_path):
    """Item 4 (#20): init containers of replicas sharing one cache downloaded concurrently
    into one folder with no lock. Three fetch processes at once on one destination: one
    downloads, the others wait for it and find it complete."""
    import subprocess
    import sys

    dest = tmp_path / "cache" / "url" / "abc" / "model.gguf"
    argv = [sys.executable, "-m", "kvship_operator.fetch", "--url", f"{server}/slow/model.gguf",
            "--dest", str(dest), "--timeout", "60"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(3)]
    try:
        outs = [p.communicate(timeout=60)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert server.requests.count("/slow/model.gguf") == 1, server.requests
    assert dest.read_bytes().startswith(b"GGUF") and not list(dest.parent.glob(".part-*"))
