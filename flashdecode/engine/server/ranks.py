"""Serving on several ranks (``flashdecode serve --tp N --cp M``): rank 0 runs the HTTP server and the AsyncEngine,
every other rank runs the same engine program on its shard of the model, driven by rank 0.

Every rank's engine must make the same scheduling decisions (the model's collectives line up only then), so each
iteration of rank 0's engine loop first broadcasts what it is about to apply - the new requests (prompt ids and
sampling params) and the aborts - as one ``Orders``; each rank applies them in the same order and then steps when
its scheduler has work, which is then true on every rank alike. Sampled tokens are rank 0's on every rank (the
engine's own agreement, ParallelState.agree_tokens), so stop tokens, stop strings and lengths end the same
sequences everywhere. While idle, rank 0 sends an empty order every HEARTBEAT_S so that the other ranks' pending
broadcast never reaches the process group's timeout. The cost: one small pickled broadcast per engine step (not yet
measured on GPUs; a step with nothing new could skip it if it shows).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading

from flashdecode.engine.llm import LLM
from flashdecode.engine.sampling import SamplingParams
from flashdecode.engine.scheduler import Sequence

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
PRUNE_AT = 1024  # requests remembered on a follower before the finished ones are dropped


@dataclasses.dataclass
class Orders:
    """One iteration of rank 0's engine loop: requests to add (in order; the k-th request ever added has ordinal k)
    and the ordinals of requests whose unfinished sequences stop now; ``stop`` ends the other ranks' loop."""

    adds: list[tuple[list[int], SamplingParams]]
    aborts: list[int]
    stop: bool = False


class Leader:
    """Rank 0's side: numbers the requests it adds and broadcasts each iteration's Orders before applying them."""

    def __init__(self, llm: LLM):
        self.parallel = llm.parallel
        self.next_ordinal = 0

    def send(self, added: list, aborted: list, stop: bool = False) -> None:
        """Broadcast ``added`` / ``aborted`` RequestStreams (each added one gets its ``ordinal`` here)."""
        for stream in added:
            stream.ordinal, self.next_ordinal = self.next_ordinal, self.next_ordinal + 1
        self.parallel.broadcast_object(Orders([(s.prompt_token_ids, s.params) for s in added],
                                              [s.ordinal for s in aborted], stop))


def follow(llm: LLM) -> None:
    """A rank other than 0: apply rank 0's Orders and step, until rank 0 stops. A failure here ends the process
    (its collectives could no longer line up with rank 0's); the launcher then stops the server."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 shuts the others down
    requests: dict[int, list[Sequence]] = {}
    ordinal = 0
    while True:
        orders: Orders = llm.parallel.broadcast_object()
        if orders.stop:
            return
        for ids, params in orders.adds:
            try:
                requests[ordinal] = llm.add_request(ids, params)
            except Exception:  # noqa: BLE001 - rank 0 fails the same request the same way and answers the client
                logger.debug("request %d failed on this rank as on rank 0", ordinal, exc_info=True)
            ordinal += 1
        for k in orders.aborts:
            llm.abort([s for s in requests.pop(k, []) if not s.finished])
        if llm.scheduler.has_work():
            llm.step_sequences()
        if len(requests) > PRUNE_AT:  # forget the finished requests
            requests = {k: seqs for k, seqs in requests.items() if not all(s.finished for s in seqs)}
