"""A deterministic tokenizer stand-in for the simulated engine.

A token is a run of word characters or a single punctuation mark:
``"Hello, world!"`` is 4 tokens. Real tokenizers split words further, but the
simulator only needs counts that are stable, cheap and easy for a load generator
to hit exactly (N plain words = N tokens).
"""

from __future__ import annotations

import random
import re

_TOKEN = re.compile(r"\w+|[^\w\s]")

# Chat templates wrap each message in role markers; vLLM counts them as prompt
# tokens, so the simulator charges a fixed overhead per message and per reply.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_REPLY = 3

_FILLER = (
    "the",
    "cache",
    "grows",
    "with",
    "every",
    "token",
    "and",
    "the",
    "pool",
    "holds",
    "only",
    "so",
    "many",
    "blocks",
    "while",
    "requests",
    "wait",
    "in",
    "the",
    "queue",
    "for",
    "memory",
    "to",
    "free",
    "as",
    "long",
    "sessions",
    "keep",
    "their",
    "context",
)


def count_tokens(text: str) -> int:
    """Number of tokens in ``text``: words and punctuation marks."""
    return len(_TOKEN.findall(text))


def tokenize(text: str) -> list[int]:
    """Stable token ids for ``text`` (a hash of each token, for ``/tokenize``)."""
    return [sum(token.encode()) % 32_000 for token in _TOKEN.findall(text)]


def count_chat_tokens(messages: list[dict[str, object]]) -> int:
    """Prompt tokens of a chat request: contents plus the template's per-message markers."""
    total = CHAT_TOKENS_PER_REPLY
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: count the text parts
            content = " ".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        total += CHAT_TOKENS_PER_MESSAGE + count_tokens(str(content or ""))
    return total


class FillerText:
    """Generated text for a request: one filler word per token, seeded per request."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def next_token(self) -> str:
        """The text of the next generated token (a word with a leading space)."""
        return " " + self._rng.choice(_FILLER)
