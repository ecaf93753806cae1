"""``ModelEp``: the head/worker command protocol trait, with single-GPU defaults."""

from __future__ import annotations

import abc
from collections.abc import MutableSequence
from typing import Generic

from .._core.state import S
from .._core.tokens import TokenArray
from .._core.words import check_u32


class ModelEp(abc.ABC, Generic[S]):
    """The multi-rank (expert-/tensor-parallel) command protocol of a model.

    Rank 0, the *head*, runs the scheduler and, before each model operation,
    broadcasts command words; every other rank, a *worker*, loops on
    [`ep_worker_step`][metrale_model_engine.ModelEp.ep_worker_step], which receives a ``(seq_id, cmd)`` header and runs
    the command in ``slots[seq_id]`` of its slot array (sized to ``--max-batch-size``).

    A mixin: inherit it beside the model's own bases (``torch.nn.Module``, say).  It
    has no ``__init__`` and ``__slots__ = ()``, so it adds no state and keeps slotted
    subclasses slotted.  Every method has a default that is right for a single-GPU
    model, which therefore overrides nothing.  A multi-rank model overrides them all
    (or inherits [`LinkedEp`][metrale_model_engine.LinkedEp], which speaks them over an
    [`EpLink`][metrale_model_engine.EpLink]).

    ``S`` is the slot type; it defaults to [`SequenceState`][metrale_model_engine.SequenceState].  Errors are
    raised exceptions: see [`EpCommandFailed`][metrale_model_engine.EpCommandFailed] for how a worker tells a failed
    command from a lost link.  Every command word and ``seq_id`` is a u32:
    ``TypeError`` for a non-``int`` (``bool`` included), ``ValueError`` outside
    ``0 ..= 0xFFFFFFFF``, even in the defaults.
    """

    __slots__ = ()

    def ep_worker_step(self, slots: MutableSequence[S | None]) -> bool:
        """Worker rank: receive one ``(seq_id, cmd)`` header and run the command.

        The command runs in ``slots[seq_id]``; under protocol v1 ``seq_id`` is not on
        the wire and is 0.  Returns ``False`` when the header is the shutdown word
        (the worker loop ends), ``True`` otherwise.

        Raises:
            EpCommandFailed: the header arrived and the command then failed
                (``seq_id >= len(slots)``, an unknown command, an error inside it).
                The worker logs it and stays in its loop; the head raises the same
                error for the same request.
            Exception: any other error means the receive failed (the link is gone)
                and the worker exits.

        Default: returns ``True`` (a single-GPU model has no workers).
        """
        return True

    def is_ep(self) -> bool:
        """Whether the multi-rank protocol is live for this model.

        When ``True`` the scheduler turns off its single-GPU fused paths (the mixed
        prefill/decode forward) and broadcasts a command before each model
        operation.  Default: ``False``.
        """
        return False

    def ep_broadcast_cmd(self, cmd: int) -> None:
        """Head: send one u32 word (a command or a follow-up word) to every worker.

        Default: checks ``cmd`` and sends nothing.
        """
        if type(cmd) is not int or cmd >> 32:
            check_u32("cmd", cmd)

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        """Head: send the header that starts a command for sequence ``seq_id``.

        The wire carries ``[cmd]`` under protocol v1 and ``[seq_id, cmd]`` under v2
        (see [`ep_protocol_v2`][metrale_model_engine.ModelEp.ep_protocol_v2]); follow-up words go with
        [`ep_broadcast_cmd`][metrale_model_engine.ModelEp.ep_broadcast_cmd].  Default: checks both words and sends
        nothing.
        """
        if type(seq_id) is not int or seq_id >> 32:
            check_u32("seq_id", seq_id)
        if type(cmd) is not int or cmd >> 32:
            check_u32("cmd", cmd)

    def ep_protocol_v2(self) -> bool:
        """Whether headers carry ``seq_id`` (``METRALE_EP_PROTOCOL=v2``).  Default: ``False``."""
        return False

    def ep_broadcast_tokens(self, tokens: TokenArray) -> list[int]:
        """Send a u32 token array from the head to every worker in one broadcast.

        The head passes its tokens and gets them back; a worker passes an array of
        the same length (its values are ignored) and gets the head's values.

        Default: returns a new empty list and looks at nothing, so a single-GPU
        model pays nothing whatever ``len(tokens)`` is.
        """
        return []
