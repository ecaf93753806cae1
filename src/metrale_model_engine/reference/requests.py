"""What a request asks and gets: ``Request`` (a prompt, how many tokens, how to pick them), its
[`Completion`][metrale_model_engine.reference.Completion], and how the head picks each token from its logits:
[`Sampling`][metrale_model_engine.reference.Sampling], applied by a [`Sampler`][metrale_model_engine.reference.Sampler].

Greedy by default (the largest logit; the lowest id on a tie).  Otherwise, as
``transformers`` orders its logits processors: the logits divided by
``temperature``, cut to the ``top_k`` largest, then to the smallest set of most
probable tokens whose probability reaches ``top_p`` (of equally probable tokens,
the lower id counts first); one token is drawn from what is left by the request's
own generator, seeded with ``seed``.  The head samples and its workers receive the
token in the next command, so a seed gives the same tokens at every world size (the
logits agree there to rounding).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Final, Literal

import torch

from .. import check_u32


@dataclass(frozen=True)
class Sampling:
    """A request's sampling: greedy when ``temperature`` is 0 (the default), else drawn (see the module).

    Attributes:
        temperature: the logits are divided by it; 0 picks the largest logit.
        top_k: keep the ``top_k`` largest logits; 0 keeps all.
        top_p: keep the smallest set of most probable tokens whose probability reaches
            ``top_p`` (nucleus sampling); 1 keeps all.
        seed: the request's generator's seed, a u63; ``None``: drawn at random when
            the request is sampled (and kept in its [`Sampler`][metrale_model_engine.reference.Sampler]).

    Raises:
        TypeError: a field has the wrong type (``bool`` is not a number).
        ValueError: ``temperature`` negative or not finite, ``top_k`` negative, ``top_p``
            not in ``(0, 1]``, or ``seed`` outside ``0 ..= 2**63 - 1``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if type(value) not in (int, float):
                raise TypeError(f"Sampling.{name} must be a number, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"Sampling.temperature must be finite and at least 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")
        for name, value in (("top_k", self.top_k), ("seed", self.seed)):
            if value is None and name == "seed":
                continue
            if type(value) is not int:
                raise TypeError(f"Sampling.{name} must be an int, got {type(value).__name__} {value!r}")
        if self.top_k < 0:
            raise ValueError(f"Sampling.top_k must be at least 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"Sampling.seed must be in 0 ..= 2**63 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Whether it picks the largest logit (``temperature == 0``)."""
        return self.temperature == 0


GREEDY = Sampling()
"""The default: the largest logit."""


class Sampler:
    """Picks one request's tokens, one call per token, with the request's own generator (see the module)."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.seed: int = secrets.randbits(63) if sampling.seed is None else sampling.seed
        """The seed in use: the request's, or the one drawn for it."""
        self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token for ``logits`` (``[vocab]``, any device and floating dtype)."""
        sampling = self.sampling
        if sampling.greedy:
            return int(torch.argmax(logits))
        scores = logits.detach().to("cpu", torch.float64) / sampling.temperature
        if 0 < sampling.top_k < scores.numel():
            scores[scores < torch.topk(scores, sampling.top_k).values[-1]] = -math.inf
        probabilities = torch.softmax(scores, dim=-1)
        if sampling.top_p < 1:
            ordered, order = torch.sort(probabilities, descending=True, stable=True)  # a tie: the lower id first
            before = torch.cumsum(ordered, dim=0) - ordered  # the probability of the tokens ahead of each
            probabilities[order[before >= sampling.top_p]] = 0.0
        cumulative = torch.cumsum(probabilities, dim=0)
        draw = float(torch.rand((), dtype=torch.float64, generator=self._generator)) * float(cumulative[-1])
        return int(torch.searchsorted(cumulative, draw, right=True))  # never a token of probability 0


FinishReason = Literal["stop", "length", "context", "error", "cancelled"]
"""Why a request ended: an end-of-sequence id (``"stop"``), its ``max_new_tokens`` (``"length"``), its
context full (``"context"``), a failure (``"error"``), [`Server.cancel`][metrale_model_engine.reference.Server.cancel]
(``"cancelled"``)."""


@dataclass(frozen=True)
class Request:
    """A prompt to continue by at most ``max_new_tokens`` tokens, picked as ``sampling`` says (greedy by default).

    It ends early at an end-of-sequence id (the server's ``eos_token_ids``), unless
    ``ignore_eos``, or when its context fills up.  With ``logprobs`` (``0 ..=
    20``), its completion keeps each token's log-probability and those of the
    ``logprobs`` likeliest tokens ([`TokenLogprobs`][metrale_model_engine.reference.TokenLogprobs]).

    Raises:
        TypeError: ``id``, a prompt token, ``max_new_tokens`` or ``logprobs`` is not an int,
            ``sampling`` is not a [`Sampling`][metrale_model_engine.reference.Sampling], or
            ``ignore_eos`` is not a bool.
        ValueError: ``id`` is not a u32, the prompt is empty, ``max_new_tokens < 1``, or
            ``logprobs`` is outside ``0 ..= 20``.
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    logprobs: int | None = None
    """How many of the likeliest tokens' log-probabilities to keep with each token; ``None``: none, not even
    the token's own."""
    ignore_eos: bool = False
    """Whether an end-of-sequence id leaves the request running (it then ends by its length or context)."""

    def __post_init__(self) -> None:
        check_u32("id", self.id)
        object.__setattr__(self, "prompt", tuple(self.prompt))
        if not self.prompt:
            raise ValueError(f"request {self.id}: the prompt is empty")
        for index, token in enumerate(self.prompt):
            if type(token) is not int:
                raise TypeError(f"request {self.id}: prompt[{index}] must be an int, got {type(token).__name__}")
        check_count(f"request {self.id}: max_new_tokens", self.max_new_tokens)
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"request {self.id}: sampling must be a Sampling, got {type(self.sampling).__name__}")
        if self.logprobs is not None:
            if type(self.logprobs) is not int:
                raise TypeError(f"request {self.id}: logprobs must be an int, got {type(self.logprobs).__name__}")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"request {self.id}: logprobs must be in 0 ..= {MAX_LOGPROBS}, got {self.logprobs}")
        if type(self.ignore_eos) is not bool:
            raise TypeError(f"request {self.id}: ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")


MAX_LOGPROBS: Final = 20
"""The most alternatives a request's ``logprobs`` may ask for."""


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability, and the ``top`` likeliest tokens' as ``(token, logprob)``, likeliest
    first (of equal ones, the lower id first), all from the logits as the model gave them (before the
    request's temperature, ``top_k`` or ``top_p``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` (``[vocab]``), and the ``top`` likeliest tokens'."""
    scores = torch.log_softmax(logits.detach().to("cpu", torch.float32), dim=-1)
    best = torch.sort(scores, descending=True, stable=True)
    pairs = zip(best.indices[:top].tolist(), best.values[:top].tolist(), strict=True)
    return TokenLogprobs(token, float(scores[token]), tuple((int(t), float(p)) for t, p in pairs))


def check_count(name: str, value: object) -> None:
    """Raise unless ``value`` is an int ``>= 1`` (``TypeError``, ``ValueError``), named ``name``."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass
class Completion:
    """What a request got: its generated tokens, the steps at which it was admitted and finished, and why it ended."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    submitted_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None
    finish_reason: FinishReason | None = None
    """``"stop"``: it generated an end-of-sequence id (the last of ``tokens``); ``"length"``:
    ``max_new_tokens`` generated; ``"context"``: cut short, its context (``max_seq_len`` positions) is
    full; ``"error"``: failed (see [`error`][metrale_model_engine.reference.Completion.error]); ``"cancelled"``:
    ended by [`Server.cancel`][metrale_model_engine.reference.Server.cancel]; ``None`` while it waits or runs."""
    error: str | None = None
    """Why it failed, ``"Type: message"``, when ``finish_reason`` is ``"error"``."""
    seed: int | None = None
    """The seed its tokens were drawn with (its sampling's, or one drawn for it); ``None`` when greedy."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One per token when the request asked for ``logprobs``, else empty."""
    preemptions: int = 0
    """How often it was preempted (its blocks freed for others' and its tokens computed again on its return);
    ``admitted_step`` stays its first admission."""
