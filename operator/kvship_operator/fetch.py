"""Model download step, run as the `fetch-model` init container of engine pods.

    python -m kvship_operator.fetch --hub Qwen/Qwen3-0.6B [--revision main] --dest /models/hub/... --timeout 3600
    python -m kvship_operator.fetch --url https://host/model.tar.gz --dest /models/url/<hash> --timeout 3600

Idempotent: a finished download leaves a marker and later runs return at once. Failures exit
non-zero with one clear line, which also goes to /dev/termination-log so that the operator
can put it in the LLMDeployment's ModelCached condition.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

MARKER = ".kvship-complete"
TERMINATION_LOG = "/dev/termination-log"
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")


class FetchError(RuntimeError):
    pass


def _done_marker(dest: Path, is_file: bool) -> Path:
    return dest.parent / f"{dest.name}{MARKER}" if is_file else dest / MARKER


def fetch_hub(repo_id: str, revision: str | None, dest: Path) -> Path:
    marker = _done_marker(dest, False)
    if marker.exists():
        return dest
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - the engine image has it
        raise FetchError("huggingface_hub is not installed in the image") from e
    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo_id=repo_id, revision=revision, local_dir=str(dest), token=os.environ.get("HF_TOKEN") or None)
    except Exception as e:  # hub errors carry useful text (404, 401 gated, ...)
        raise FetchError(f"download of {repo_id} failed: {type(e).__name__}: {e}") from e
    marker.write_text(repo_id + "\n")
    return dest


def _safe_extract(archive: Path, dest: Path) -> None:
    dest_real = dest.resolve()
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for n in zf.namelist():
                if not (dest / n).resolve().is_relative_to(dest_real):
                    raise FetchError(f"archive member escapes the destination: {n}")
            zf.extractall(dest)
        return
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")


def fetch_url(url: str, dest: Path) -> Path:
    """Download ``url``; archives are unpacked into ``dest`` (a folder), other files are
    saved as ``dest`` (a file path)."""
    base = url.split("?", 1)[0].split("#", 1)[0]
    archive = base.endswith(ARCHIVES)
    marker = _done_marker(dest, not archive)
    if marker.exists():
        return dest
    folder = dest if archive else dest.parent
    folder.mkdir(parents=True, exist_ok=True)
    headers = {"User-Agent": "kvship-fetch"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".part-")
    try:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r, os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(r, out, length=1 << 20)
        except Exception as e:
            raise FetchError(f"download of {url} failed: {e}") from e
        if archive:
            suffix = next(s for s in ARCHIVES if base.endswith(s))
            named = Path(tmp + suffix)
            os.replace(tmp, named)
            tmp = str(named)
            try:
                _safe_extract(named, dest)
            except (tarfile.TarError, zipfile.BadZipFile) as e:
                raise FetchError(f"{url} is not a valid {suffix} archive: {e}") from e
        else:
            os.replace(tmp, dest)
            tmp = ""
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    marker.write_text(url + "\n")
    return dest


@contextlib.contextmanager
def download_lock(dest: Path):
    """An exclusive lock (flock; NFS clients map it to a POSIX lock) beside ``dest``, held
    while it is downloaded; waiting for it counts against the download's time limit."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fail(message: str) -> int:
    print(f"kvship fetch: {message}", file=sys.stderr)
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(message[-4000:])
    except OSError:
        pass
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvship_operator.fetch", description="Download a model into the cache.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hub", help="hub model id")
    src.add_argument("--url", help="http(s) URL of a file or archive")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds before giving up")
    args = ap.parse_args(argv)

    def on_alarm(*_: object) -> None:
        raise FetchError(f"download did not finish within {args.timeout} s (raise spec.downloadTimeoutSeconds)")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, args.timeout))
    try:
        # replicas sharing one cache (modelCache.mode Shared) download one at a time: the
        # first one downloads, the others wait here and then find it complete
        with download_lock(Path(args.dest)):
            if args.hub:
                path = fetch_hub(args.hub, args.revision, Path(args.dest))
            else:
                path = fetch_url(args.url, Path(args.dest))
    except FetchError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot write the model cache: {e}")
    finally:
        signal.alarm(0)
    print(f"kvship fetch: model ready at {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
