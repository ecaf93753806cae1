"""How the head picks a request's tokens: greedy by default, else temperature, top-k, top-p and a seed of its own.

The same seed at 1, 2 and 4 ranks: ``tests/ranks/test_checkpoint.py``.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine import EpLink
from metrale_model_engine.reference import GREEDY, ReferenceLm, Request, Sampler, Sampling, Server
from metrale_model_engine.transport import SoloTransport

from helpers.greedy import byte_ids

pytestmark = pytest.mark.torch

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 3.0, -1.0])
"""Two largest logits tie (ids 1 and 4): greedy picks the lower id."""


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"temperature": -0.5}, ValueError, "Sampling.temperature must be finite and at least 0, got -0.5"),
        ({"temperature": math.inf}, ValueError, "Sampling.temperature must be finite and at least 0, got inf"),
        ({"temperature": "1"}, TypeError, "Sampling.temperature must be a number, got str '1'"),
        ({"top_p": 0.0}, ValueError, r"Sampling.top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"Sampling.top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, ValueError, "Sampling.top_k must be at least 0, got -1"),
        ({"top_k": 2.0}, TypeError, "Sampling.top_k must be an int, got float 2.0"),
        ({"seed": 2**63}, ValueError, r"Sampling.seed must be in 0 \.\.= 2\*\*63 - 1, got 9223372036854775808"),
        ({"seed": True}, TypeError, "Sampling.seed must be an int, got bool True"),
    ],
)
def test_sampling_fields_are_checked(fields: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Sampling(**fields)  # type: ignore[arg-type]


def test_greedy_is_the_largest_logit_the_lowest_id_on_a_tie() -> None:
    assert GREEDY.greedy and Sampler(GREEDY)(LOGITS) == 1
    assert Sampler(GREEDY).seed is not None and Sampling(top_k=3, seed=5).greedy  # temperature 0: greedy all the same
    assert Sampler(Sampling(temperature=1.0, top_k=1, seed=3))(torch.tensor([0.0, 5.0, 1.0])) == 1  # one kept


def test_a_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    sampling = Sampling(temperature=1.0, seed=11)
    draws = [[Sampler(sampling)(LOGITS) for _ in range(1)] for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    first, again = Sampler(sampling), Sampler(sampling)
    sequence = [first(LOGITS) for _ in range(50)]
    assert sequence == [again(LOGITS) for _ in range(50)]
    other = Sampler(Sampling(temperature=1.0, seed=12))
    assert sequence != [other(LOGITS) for _ in range(50)]


def test_draws_follow_the_distribution_that_is_left() -> None:
    """2,000 draws of a fixed seed: the softmax at temperature 2 of the top 3; the nucleus of top_p."""
    sampler = Sampler(Sampling(temperature=2.0, top_k=3, seed=0))
    counts = torch.bincount(torch.tensor([sampler(LOGITS) for _ in range(2000)]), minlength=6)
    kept = torch.softmax(LOGITS[[1, 2, 4]] / 2.0, dim=0)
    assert counts[[0, 3, 5]].sum() == 0  # cut by top_k
    torch.testing.assert_close(counts[[1, 2, 4]] / 2000, kept, atol=0.04, rtol=0)
    # at temperature 1 ids 1 and 4 have 0.384 each, id 2 0.141: the most probable that reach top_p are kept
    for top_p, kept_ids in ((0.7, {1, 4}), (0.8, {1, 2, 4}), (0.3, {1})):  # 0.3: of a tie, the lower id
        nucleus = Sampler(Sampling(temperature=1.0, top_p=top_p, seed=0))
        assert {nucleus(LOGITS) for _ in range(500)} == kept_ids, top_p


def test_a_served_request_samples_with_its_own_seed_which_it_reports() -> None:
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=2))
    prompt = tuple(byte_ids("Licensed under the"))
    sampled = Sampling(temperature=8.0, seed=99)  # the shipped model knows its text: a high temperature strays
    server = Server(model)
    done = server.run([Request(0, prompt, 16, sampled), Request(1, prompt, 16, sampled), Request(2, prompt, 16)])
    assert done[0].tokens == done[1].tokens != done[2].tokens  # one seed, one draw; greedy is another text
    assert (done[0].seed, done[2].seed) == (99, None)
    drawn = Server(model).run([Request(3, prompt, 4, Sampling(temperature=1.0))])[3]
    assert isinstance(drawn.seed, int) and 0 <= drawn.seed < 2**63  # drawn for it, and said
    with pytest.raises(TypeError, match="request 4: sampling must be a Sampling, got dict"):
        Request(4, prompt, 1, {"temperature": 1.0})  # type: ignore[arg-type]
