"""``LinkedEp``: the trait, implemented by a model that holds an [`EpLink`][metrale_model_engine.EpLink]."""

from __future__ import annotations

from collections.abc import Collection, MutableSequence
from typing import Any, ClassVar, NoReturn, cast

from typing_extensions import Self

from .._core.protocol import ProtocolVersion
from .._core.reform import Reform
from .._core.state import S
from .._core.tokens import TokenArray, token_count
from .._core.words import check_u32
from .._engine.forward import declare_collective_commands
from .._engine.link import EpLink, opt_in
from .model_ep import ModelEp


class _NoLink:
    """What ``ep_link`` is until a model assigns its link: every use says so."""

    __slots__ = ()

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            "this model has no link yet: a LinkedEp model assigns its engine in __init__, "
            "self.ep_link = EpLink(transport, num_slots=...) (did its __init__ skip that, or skip super().__init__()?)"
        )


class LinkedEp(ModelEp[S]):
    """A ``ModelEp`` whose six methods speak the protocol over the model's link, ``self.ep_link``.

    Inherit it beside the model's own bases (``torch.nn.Module``, say), assign the
    link in ``__init__`` (``self.ep_link = EpLink(transport, num_slots=...)``) and
    override [`ep_run_command`][metrale_model_engine.LinkedEp.ep_run_command], the worker hook.  The head side of a
    command is a call to ``self.ep_link.send_command(seq_id, cmd, *follow_ups)`` (or the
    trait's per-word broadcasts); the worker side reads the follow-ups with
    ``self.ep_link.recv_word()``, ``recv_tokens()`` and ``recv_tokens_into()``.

    A model whose commands run collectives (an all-reduce in the forward) declares
    those command words in [`ep_collective_commands`][metrale_model_engine.LinkedEp.ep_collective_commands], runs its
    collectives through ``metrale_model_engine.torch.Collectives`` and its head's forward inside
    ``with self.ep_link.collective():``: then any failure of such a command, on any
    rank, stops the run on every rank within seconds (see
    [`RunStopped`][metrale_model_engine.RunStopped]), where it would otherwise leave the
    other ranks waiting in the collective.

    A model that survives a lost worker rank opts in with
    [`ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms] and takes up its new place in
    [`ep_reformed`][metrale_model_engine.LinkedEp.ep_reformed]: the head then calls
    [`reform_link`][metrale_model_engine.reform.reform_link] on a ``RunStopped``, and the workers left go on.

    It adds nothing else to the model's class: the trait's six methods, the two hooks,
    [`ep_collective_commands`][metrale_model_engine.LinkedEp.ep_collective_commands],
    [`ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms], the ``ep_link`` attribute, and
    ``with model:`` (which closes the link on the way out).  As the model assigns
    ``self.ep_link``, the link is handed its ``ep_collective_commands``: the head then
    refuses a command of one of them whose forward it never entered (see
    [`EpLink.collective`][metrale_model_engine.EpLink.collective]).  It has no ``__init__`` and
    ``__slots__ = ()``: a slotted model declares an ``"ep_link"`` slot.
    """

    __slots__ = ()

    ep_link: EpLink = cast(EpLink, _NoLink())
    """The engine this model speaks through; the model assigns it in ``__init__``."""

    ep_collective_commands: ClassVar[Collection[int]] = frozenset()
    """The command words whose forward runs collectives on every rank; default none.

    A worker that fails one of them (a plain exception in the hook or its forward, a
    failed check, a follow-up read too few or too many times) refuses it
    ([`EpCommandRefused`][metrale_model_engine.EpCommandRefused]) instead of failing it as an
    ordinary command: the run stops on every rank.  A ``frozenset`` (or a ``set``) of
    u32 words, as a class attribute.
    """

    ep_reforms: ClassVar[bool] = False
    """Whether the model's link forms again over the ranks left once worker ranks are lost; default ``False``.

    ``True`` (a class attribute): a worker rank lost (its process exited or was
    killed, or its host fell silent past ``head_lost_after``) stops the run wherever
    the head finds it, a send included ([`RunStopped`][metrale_model_engine.RunStopped],
    naming it and how); the head's [`reform_link`][metrale_model_engine.reform.reform_link]
    then forms the link again over itself and the workers left, with no process
    restarted: a new epoch, the ranks renumbered in their order (the head stays 0), a
    new transport; every rank's [`ep_reformed`][metrale_model_engine.LinkedEp.ep_reformed]
    takes up its new place before the next command, and each worker's
    [`run_worker`][metrale_model_engine.run_worker] goes on.  Losses repeat down to the
    head alone (the single-GPU model).  ``False``: a lost worker ends the run on every
    rank, as without re-forms.
    """

    def __setattr__(self, name: str, value: Any) -> None:  # Any: torch.nn.Module's, beside it, takes its own
        """Set the attribute; a link assigned to ``ep_link`` is handed ``ep_collective_commands`` and ``ep_reforms``."""
        super().__setattr__(name, value)
        if name == "ep_link" and isinstance(value, EpLink):
            declare_collective_commands(value, self.ep_collective_commands)
            if self.ep_reforms:
                opt_in(value)

    def ep_worker_step(self, slots: MutableSequence[S | None]) -> bool:
        """Worker: receive one header and run its command through ``ep_run_command`` (as ``EpLink.step``)."""
        return self.ep_link.step(self.ep_run_command, slots, self.ep_collective_commands)

    def is_ep(self) -> bool:
        """``True`` exactly when the link's group has more than one rank."""
        return self.ep_link.world_size > 1

    def ep_broadcast_cmd(self, cmd: int) -> None:
        """Head: send one u32 follow-up word of the command in flight (``EpLink.send_word``)."""
        if type(cmd) is not int or cmd >> 32:
            cmd = check_u32("cmd", cmd)
        self.ep_link.send_word(cmd)

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        """Head: send the header that starts command ``cmd`` for ``seq_id`` (``EpLink.send_header``)."""
        self.ep_link.send_header(seq_id, cmd)

    def ep_protocol_v2(self) -> bool:
        """``True`` when the link runs protocol v2 (``seq_id`` in every header)."""
        return self.ep_link.protocol is ProtocolVersion.V2

    def ep_broadcast_tokens(self, tokens: TokenArray) -> list[int]:
        """Send a u32 token array from the head to every worker.

        Head: ``tokens`` is checked and sent ([`EpLink.send_tokens`][metrale_model_engine.EpLink.send_tokens]) and
        returned (the same object when it is a list).  Worker: receives the head's
        array, which must have ``len(tokens)`` tokens ([`EpLink.recv_tokens`][metrale_model_engine.EpLink.recv_tokens]).
        """
        link = self.ep_link
        if link.rank:
            return link.recv_tokens(token_count(tokens))
        sent = link.send_tokens(tokens)
        return tokens if isinstance(tokens, list) else memoryview(sent).tolist()

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[S | None]) -> None:
        """Worker hook: run command ``cmd`` in ``slots[seq_id]`` (override it).

        Called by [`ep_worker_step`][metrale_model_engine.LinkedEp.ep_worker_step] once the header arrived and
        ``seq_id`` is known to be in range.  Read the command's follow-ups before anything that
        may fail: the link skips what a failed command left unread, but state the
        command changed before failing stays changed.  Any exception it raises
        becomes [`EpCommandFailed`][metrale_model_engine.EpCommandFailed]
        ([`EpCommandRefused`][metrale_model_engine.EpCommandRefused] for one of
        [`ep_collective_commands`][metrale_model_engine.LinkedEp.ep_collective_commands]: the run stops), except a
        receive failure and a [`RunStopped`][metrale_model_engine.RunStopped], which pass as they are.

        Default: every command is unknown (``ValueError``).
        """
        raise ValueError(f"unknown command word {cmd} (seq_id={seq_id}) for {type(self).__name__}")

    def ep_reformed(self, reform: Reform, slots: MutableSequence[S | None]) -> None:
        """Every rank, once its link re-formed ([`ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms]): take up the
        new place, rank ``reform.rank`` of ``reform.world_size`` (override it).

        Called before anything of the new epoch runs: on a worker by
        [`run_worker`][metrale_model_engine.run_worker], on the head by
        [`reform_link`][metrale_model_engine.reform.reform_link] before it returns.  ``self.ep_link``
        is the same link, in its new epoch (``rank``, ``world_size`` and ``epoch`` are
        the new ones); ``reform`` also says which ranks were lost (``lost``) and, on the
        head, which commands workers reported failing (``failures``).  Reshard what
        depends on the rank and the world size here, over the new ranks (the model's
        own process groups too: ``Collectives`` over the default group follows by
        itself).  ``slots`` are as the last epoch left them: a command that ran on some
        ranks and not on others is the model's (or its scheduler's) to redo.  On a
        worker an exception ends it (the head loses it at its next command); on the
        head the link is closed and ``reform_link`` raises ``RunStopped``.

        Default: nothing (a model whose state does not depend on its place).
        """

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the link (and its transport): a head that did not shut its workers down makes them raise."""
        self.ep_link.close()
