"""The engine as an OpenAI-compatible HTTP server: ``flashdecode serve --model DIR``.

    from flashdecode.engine.server.launch import ServerThread   # tests / benchmarks: a server on a loopback port

FastAPI and uvicorn (the "serve" extra) are imported only when a server is built, so that the rest of the CLI works
without them.
"""

import importlib

_LAZY = {"build_app": "flashdecode.engine.server.app", "AsyncEngine": "flashdecode.engine.server.async_engine",
         "QueueFull": "flashdecode.engine.server.async_engine"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
