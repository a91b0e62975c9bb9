"""The checkpoint's tokenizer (transformers' AutoTokenizer from local files) and incremental detokenisation.

A checkpoint directory has a tokenizer when it holds tokenizer.json or tokenizer_config.json; the chat template
comes from tokenizer_config.json's "chat_template" or chat_template.jinja (AutoTokenizer reads both).
"""

from __future__ import annotations

import threading
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer:
    """encode / decode / chat template of one checkpoint directory (no network access).

    Thread-safe: the server encodes on its event loop while the engine thread detokenises, and a Rust tokenizer
    used from two threads at once can fail ("Already borrowed"), so every call holds one lock.
    """

    def __init__(self, model_dir: str | Path):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is in the serve/dev extras
            raise ImportError("text prompts need transformers: pip install 'flashdecode[serve]'") from e
        self.model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._lock = threading.Lock()
        eos = self.hf.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        """The conversation rendered by the checkpoint's chat template (or ``chat_template``) as prompt text."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError(f"model_dir {str(self.model_dir)!r} has no chat template (tokenizer_config.json "
                             f"'chat_template' or chat_template.jinja); pass chat_template=")
        with self._lock:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               chat_template=chat_template)


def load_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has none (token-id prompts only)."""
    if model_dir is None or not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    return Tokenizer(model_dir)


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, one delta per token, never splitting a UTF-8 character.

    Byte-level tokenizers emit characters in pieces: a token may hold half of a multi-byte character, which
    decodes to U+FFFD until the rest arrives. Each step decodes a short window ``ids[prefix:]`` and compares it
    with ``ids[prefix:read]`` (the already emitted part of the window, decoded with the same left context so
    spacing rules of the tokenizer apply equally to both); the difference is new text unless it ends in U+FFFD,
    in which case it waits for the next token. The concatenated deltas equal decode(all ids) for tokenizers
    whose decode is prefix-stable; ``flush`` emits what is still pending (an incomplete character) at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start (left context)
        self.read = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text ('' while a character is incomplete)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(before):]

    def flush(self) -> str:
        """At the end: the pending text (an incomplete character decodes to U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return window[len(before):]
