"""What a request returns (vLLM's RequestOutput / CompletionOutput) and the text of a sequence: lazy incremental
detokenisation and stop strings."""

from __future__ import annotations

import dataclasses

from flashdecode.engine.scheduler import Scheduler, Sequence


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's fields). ``token_ids`` are the generated ids (a stop token, EOS or a
    stop_token_id, included when it ended there); ``text`` their detokenised text, cut before a stop string;
    ``logprobs`` one dict token id -> log-probability per generated token when asked for; ``stop_reason`` the stop
    string or stop token id that ended it (None for EOS / length)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result: its n completions in ``outputs`` (``token_ids`` / ``text`` / ``finish_reason`` read
    the first one)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_preemptions: int = 0
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def update_text(seq: Sequence) -> str:
    """Bring ``seq.text`` up to its tokens (detokenisation is lazy: only sequences with stop strings need it every
    step; the server asks every step for streaming, ``generate`` once at the end). Returns the new text."""
    if seq.detokenizer is None or seq.text_final:
        return ""
    pending = seq.num_generated - seq.num_detokenized
    delta = seq.detokenizer.step(seq.token_ids[len(seq.token_ids) - pending:]) if pending else ""
    seq.num_detokenized = seq.num_generated
    if seq.finished:
        delta += seq.detokenizer.flush()
        seq.text_final = True
    seq.text += delta
    return delta


def completion_output(seq: Sequence) -> CompletionOutput:
    update_text(seq)
    return CompletionOutput(seq.index, seq.text if seq.detokenizer is not None else None, seq.output_token_ids,
                            seq.cumulative_logprob, seq.logprobs, seq.finish_reason, seq.stop_reason)


def request_output(prompt, seqs: list[Sequence]) -> RequestOutput:
    """The result of one finished request: ``prompt`` as given (its text kept when it was a str) and its n
    sequences."""
    first = seqs[0]
    return RequestOutput(prompt if isinstance(prompt, str) else None, first.token_ids[:first.num_prompt_tokens],
                         [completion_output(s) for s in seqs], first.prompt_logprobs,
                         sum(s.num_preemptions for s in seqs))


def check_stop_strings(seq: Sequence, scheduler: Scheduler) -> bool:
    """Extend ``seq.text`` by its newest tokens; finish it at a stop string. True if that finished it."""
    delta = update_text(seq)
    stops = seq.params.stop
    if not delta or seq.num_generated < seq.params.min_tokens:
        return False
    longest = max(len(s) for s in stops)
    start = max(0, len(seq.text) - len(delta) - longest + 1)  # a match must end in the new text
    hits = [(pos, s) for s in stops if (pos := seq.text.find(s, start)) >= 0]
    if not hits:
        return False
    pos, stop = min(hits)
    seq.text = seq.text[:pos + (len(stop) if seq.params.include_stop_str_in_output else 0)]
    seq.text_final = True  # pending characters after the stop string are never added
    if seq.finished:  # it also hit a stop token or the length in this step: the stop string wins
        seq.finish_reason, seq.stop_reason = "stop", stop
        return False
    scheduler.finish(seq, "stop", stop)
    return True
