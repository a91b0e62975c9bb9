"""Starting the ranks: torchrun's env:// rendezvous when it launched us, else an internal spawn of local processes.

    torchrun --nproc-per-node 2 -m flashdecode generate --tp 2 ...      # env:// (RANK, WORLD_SIZE, MASTER_ADDR...)
    results = spawn(fn, 2, args)                                          # fn(rank, *args) in 2 fresh processes

The default backend is NCCL when CUDA is available (one GPU per local rank), gloo otherwise.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "default_backend", "init_distributed", "launched_by_torchrun", "spawn", "main_on_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(world_size: int, backend: str | None = None) -> None:
    """Join the default process group of ``world_size`` ranks: nothing to do if it exists (spawn, or the user's
    own init), env:// when torchrun started us. On CUDA each rank takes GPU LOCAL_RANK. RuntimeError otherwise."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"tensor_parallel_size x context_parallel_size = {world_size} but the process group has "
                             f"{dist.get_world_size()} ranks")
        return
    if not launched_by_torchrun():
        raise RuntimeError(f"{world_size} ranks are needed: launch with `torchrun --nproc-per-node {world_size} ...` "
                           f"or from flashdecode.distributed.launch.spawn")
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"tensor_parallel_size x context_parallel_size = {world_size} but torchrun started "
                         f"{os.environ['WORLD_SIZE']} ranks")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://")


def _entry(rank, world_size, port, backend, fn, args, results):
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            # plain pickle copies tensors by value: torch's queue pickler would share them through the rank's
            # file descriptors, which die with the rank
            results.put((rank, True, pickle.dumps(fn(rank, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank's traceback
        results.put((rank, False, traceback.format_exc()))


def spawn(fn, world_size: int, args: tuple = (), *, backend: str | None = None, timeout_s: float | None = None,
          env: dict[str, str] | None = None):
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes joined in one process group (tcp on 127.0.0.1,
    a free port). Returns the ranks' return values (picklable) in rank order. A rank's exception is re-raised here
    as RuntimeError with its traceback; past ``timeout_s`` the ranks are terminated and TimeoutError raised.
    ``fn`` must be importable by the children (a module-level function). ``env``: extra environment variables of
    the children, set before they import anything (e.g. TRITON_INTERPRET=1, which Triton reads at import)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend or default_backend(), fn, args, results),
                         daemon=True) for r in range(world_size)]
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"spawned ranks did not finish within {timeout_s} s (done: {sorted(out)})")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0) if left is not None else 1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


def _cli_rank(rank, fn, args):
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the rank's process ends with the command
    return fn(args)


def main_on_ranks(fn, args, world_size: int, timeout_s: float | None = None, backend: str | None = None):
    """Run a command ``fn(args) -> exit code`` on ``world_size`` ranks, printing from rank 0 only.

    Already a rank (torchrun, or a process group exists): silences this process's stdout unless it is rank 0 and
    returns None - the caller goes on with the command. Otherwise spawns the ranks (process group ``backend``,
    default_backend() by default), each running ``fn(args)`` (``fn`` importable, e.g. a CLI module's run), and
    returns rank 0's exit code."""
    if dist.is_initialized() or launched_by_torchrun():
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
        if rank != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return None
    return spawn(_cli_rank, world_size, (fn, args), timeout_s=timeout_s, backend=backend)[0]
