"""Run the app under uvicorn: in the foreground (``flashdecode serve``) or in a thread on a loopback port (tests,
``flashdecode bench serve``)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from flashdecode.engine.llm import LLM
from flashdecode.engine.server.app import build_app
from flashdecode.engine.server.async_engine import AsyncEngine


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = a free port chosen by the OS, read back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class ServerThread:
    """The server for ``llm`` in a background thread on ``host`` (loopback by default), a free port by default.
    Use as a context manager; ``url`` is the base URL (``{url}/v1`` for the openai client)."""

    def __init__(self, llm: LLM, model_name: str = "flashdecode", host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = 256, startup_timeout: float = 60.0):
        self.engine = AsyncEngine(llm, max_queue=max_queue)
        self.app = build_app(self.engine, model_name)
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="flashdecode-http", daemon=True)
        self.startup_timeout = startup_timeout

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine.shutdown()
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(llm: LLM, model_name: str, host: str, port: int, max_queue: int, log_level: str = "info") -> None:
    """Serve in the foreground until interrupted."""
    engine = AsyncEngine(llm, max_queue=max_queue)
    uvicorn.run(build_app(engine, model_name), host=host, port=port, log_level=log_level)
