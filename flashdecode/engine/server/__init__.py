"""The engine as an OpenAI-compatible HTTP server: ``flashdecode serve --model DIR``.

    from flashdecode.engine.server.launch import ServerThread   # tests / benchmarks: a server on a loopback port
"""

from flashdecode.engine.server.app import build_app
from flashdecode.engine.server.async_engine import AsyncEngine, QueueFull

__all__ = ["build_app", "AsyncEngine", "QueueFull"]
