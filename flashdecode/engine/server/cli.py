"""`flashdecode serve`: the engine as an OpenAI-compatible HTTP server.

    flashdecode serve --model DIR --port 8000
    flashdecode serve --model DIR --tp 2          # 2 local ranks (or under torchrun); rank 0 serves HTTP
    curl localhost:8000/v1/chat/completions -d '{"model": "DIR", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import logging

from flashdecode.engine.cli import add_engine_arguments, add_parallel_arguments, build_llm, join_ranks

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, default_max_num_seqs=32)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: --model as given, or the config name)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="sequences that may wait beyond max-num-seqs; more get 429")
    add_parallel_arguments(parser)  # rank 0 serves HTTP, the others follow its engine steps


# third-party packages of the server (pyproject's "serve" extra); the CLI itself runs without them
_SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")


def run(args) -> int:
    try:
        from flashdecode.engine.server.launch import run_server
    except ModuleNotFoundError as e:
        if e.name not in _SERVER_PACKAGES:
            raise
        raise ImportError(f"flashdecode serve needs FastAPI and uvicorn ({e.name} is missing): "
                          "pip install 'flashdecode[serve]'") from e

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    code = join_ranks(run, args)
    if code is not None:
        return code
    llm = build_llm(args)
    if llm.parallel.rank != 0:  # the other ranks run rank 0's engine steps on their shards until it stops
        from flashdecode.engine.server.ranks import follow

        follow(llm)
        return 0
    name = args.served_model_name or args.model or args.random_weights
    logger.info("serving %r on http://%s:%d/v1", name, args.host, args.port)
    run_server(llm, name, args.host, args.port, args.max_queue,
               log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
    return 0
