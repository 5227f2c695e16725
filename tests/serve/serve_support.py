"""Helpers for the serve tests: a uvicorn server in a thread, the library's generation.

`start_server` binds a free loopback port itself (no race), runs uvicorn on a daemon thread
and waits until it accepts connections. `engine_text` is the reference the server's output is
compared with: `Model.generate` with the request's sampling and a one-chunk prefill.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn

from cfr_atlas.errors import ConfigError
from cfr_atlas.sampling import SamplingParams
from cfr_atlas.serve import ServerConfig, create_app

MODEL = "tiny"  # the name the servers are started with; clients see "tiny:latest"


@dataclass
class RunningServer:
    url: str
    app: object
    cache_dir: Path
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def service(self):
        return self.app.state.service

    def stats(self):
        return self.service.scheduler.stats()

    def wait_for(self, predicate, timeout: float = 15.0, what: str = "condition"):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate(self.stats()):
                return self.stats()
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}: {self.stats()}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def start_server(model, cache_dir: Path, **config) -> RunningServer:
    app = create_app(model, ServerConfig(model_name=MODEL, cache_dir=str(cache_dir), **config))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return RunningServer(url, app, cache_dir, server, thread)




def engine_text(model, prompt: str, params: SamplingParams, n: int) -> str:
    """The library's generation with the whole prompt as one prefill chunk: no scheduler, no
    server, and a chunking the server never uses (results are batch-invariant)."""
    n_prompt = len(model.tokenize(prompt))
    return model.generate(prompt, max_tokens=n, chunk_tokens=n_prompt, **asdict(params))


def small_budget(model) -> int:
    """A K/V budget just above the session's fixed scratch: tight enough that a prompt of a few
    pages must regenerate pages, whatever the scratch formula is today."""
    budget = 16 << 10
    while True:  # in 16 KiB steps: doubling overshot the scratch by up to 2x
        try:
            model.session(kv_budget=budget).close()
            return budget + (16 << 10)
        except ConfigError:
            budget += 16 << 10
