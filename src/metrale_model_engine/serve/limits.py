"""What the server admits: every limit on a request and on the queue, checked in one place before anything
reaches the scheduler (so no bad request reaches a worker).

A request's prompt and its new tokens must fit the context and the KV cache (a request that needs more
blocks than the whole cache holds could never run); a request is taken
while the requests in the server (running or waiting) stay within the slots plus
``--max-waiting``, else it is answered 503 with ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .protocol import ApiError, bad

RETRY_AFTER_S: Final = 1
"""What a 503's ``Retry-After`` says, in seconds."""


@dataclass(frozen=True)
class Limits:
    """The server's limits: the context, the vocabulary, the slots and the queue beyond them, and the positions the
    KV cache holds (its blocks times their size)."""

    max_seq_len: int
    vocab_size: int
    slots: int
    max_waiting: int
    kv_positions: int

    @property
    def most_requests(self) -> int:
        """Requests the server holds at once, running or waiting."""
        return self.slots + self.max_waiting

    def new_tokens(self, prompt: Sequence[int], max_tokens: int | None, param: str, where: str = "prompt") -> int:
        """The tokens a request may generate: ``max_tokens``, or (``None``) what its context leaves.

        Raises:
            ApiError: 400 for an empty prompt, an id outside the vocabulary, or a prompt and
                ``max_tokens`` that do not fit the context (the numbers said).
        """
        if not prompt:
            raise bad(where, "the prompt is empty: it needs at least one token")
        for index, token in enumerate(prompt):
            if not 0 <= token < self.vocab_size:
                raise bad(where, f"token {index} is {token}, outside the vocabulary (0 ..= {self.vocab_size - 1})")
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise bad(
                where,
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_seq_len} tokens, which "
                "leaves none to generate",
            )
        pooled = self.kv_positions - len(prompt) + 1  # the last new token is never fed: it takes no position
        if pooled < 1:
            raise bad(
                where,
                f"the prompt has {len(prompt)} tokens, more than the {self.kv_positions} positions this server's KV "
                "cache holds: it could never run",
            )
        if max_tokens is None:
            return min(room, pooled)
        if max_tokens > room:
            raise bad(
                param,
                f"{max_tokens} new tokens and a prompt of {len(prompt)} make {len(prompt) + max_tokens}, more than "
                f"this model's context of {self.max_seq_len} tokens (at most {room} here)",
            )
        if max_tokens > pooled:
            raise bad(
                param,
                f"{max_tokens} new tokens and a prompt of {len(prompt)} need {len(prompt) + max_tokens - 1} positions "
                f"of the KV cache, more than the {self.kv_positions} it holds (at most {pooled} new tokens here)",
            )
        return max_tokens

    def admit(self, held: int, adding: int) -> None:
        """Raise unless ``adding`` more requests fit beside the ``held`` ones.

        Raises:
            ApiError: 400 when ``adding`` could never fit (``n`` times the prompts); 503 with
                ``Retry-After`` when they do not fit now.
        """
        if adding > self.most_requests:
            raise bad(
                "n",
                f"the request makes {adding} sequences (n times the prompts), more than this server holds at once "
                f"({self.slots} slots + --max-waiting {self.max_waiting})",
            )
        if held + adding > self.most_requests:
            raise ApiError(
                503,
                f"the server is full: {held} requests running or waiting, at most {self.most_requests} "
                f"({self.slots} slots + --max-waiting {self.max_waiting}); retry later",
                retry_after=RETRY_AFTER_S,
            )
