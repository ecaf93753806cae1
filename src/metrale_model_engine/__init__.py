"""metrale-model-engine: the ``ModelEp`` head/worker command protocol of Metrale, typed.

Rank 0, the head, runs the scheduler and, before each model operation, sends a
command (a ``(seq_id, cmd)`` header and its follow-up words and token arrays) to
every other rank, a worker, which runs it in ``slots[seq_id]`` of its slot array.
[`ModelEp`][metrale_model_engine.ModelEp] is the trait, with single-GPU defaults.  A multi-rank model
inherits [`LinkedEp`][metrale_model_engine.LinkedEp] (the trait, implemented) and holds an
[`EpLink`][metrale_model_engine.EpLink] (the engine: setup agreement, sends, receives) in ``self.ep_link``; a worker
runs [`run_worker`][metrale_model_engine.run_worker].

Where the rest lives: [`metrale_model_engine.shm`][metrale_model_engine.shm] (the shared-memory
transport), [`metrale_model_engine.torch`][metrale_model_engine.torch] (torch.distributed: transport, group
setup, transport choice; extra ``torch``), [`metrale_model_engine.reform`][metrale_model_engine.reform] (a run
that goes on past a lost worker), [`metrale_model_engine.testing`][metrale_model_engine.testing]
(recording and replay without processes), [`metrale_model_engine.transport`][metrale_model_engine.transport]
(the transport protocol and its errors), [`metrale_model_engine.wire`][metrale_model_engine.wire] (the
wire format, for peer implementers).  Importing this package never imports torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from ._core import errors as _errors
from ._core.checks import check_slot
from ._core.errors import *  # noqa: F403  (the exception classes, as listed in _errors.__all__)
from ._core.namespace import PublicDir, public_dir
from ._core.protocol import PROTOCOL_ENV_VAR, ProtocolVersion
from ._core.state import SequenceState
from ._core.tokens import ArrayInterface, TokenArray, as_u32_buffer
from ._core.words import CMD_SHUTDOWN, U32_MAX, check_u32
from ._engine.link import EpLink
from ._engine.settings import DEFAULT_COMMAND_TIMEOUT
from ._trait.linked_ep import LinkedEp
from ._trait.model_ep import ModelEp
from ._trait.worker_loop import WorkerSummary, run_worker
from .transport import EpTransport

__all__ = [
    "CMD_SHUTDOWN",
    "DEFAULT_COMMAND_TIMEOUT",
    "PROTOCOL_ENV_VAR",
    "U32_MAX",
    "ArrayInterface",
    "EpLink",
    "EpTransport",
    "LinkedEp",
    "ModelEp",
    "ProtocolVersion",
    "SequenceState",
    "TokenArray",
    "WorkerSummary",
    "as_u32_buffer",
    "check_slot",
    "check_u32",
    "run_worker",
]

__all__ += _errors.__all__

__version__ = "0.1.0"

__dir__: PublicDir = public_dir(globals(), __all__)
"""The names a user writes (``__all__``), the loaded public submodules, the dunders (PEP 562)."""

if TYPE_CHECKING:
    from .wire import FRAME_WORDS as FRAME_WORDS
    from .wire import U32_MIN as U32_MIN
    from .wire import U32_TYPECODE as U32_TYPECODE
    from .wire import WIRE_VERSION as WIRE_VERSION
    from .wire import ItemKind as FrameKind  # noqa: F401  (a deprecated alias; see __getattr__)

    EpProtocol = ProtocolVersion
else:
    _RENAMED = {  # old name: (its new home, its new name there)
        "EpProtocol": ("metrale_model_engine", "ProtocolVersion"),
        "FRAME_WORDS": ("metrale_model_engine.wire", "FRAME_WORDS"),
        "WIRE_VERSION": ("metrale_model_engine.wire", "WIRE_VERSION"),
        "FrameKind": ("metrale_model_engine.wire", "ItemKind"),
        "U32_MIN": ("metrale_model_engine.wire", "U32_MIN"),
        "U32_TYPECODE": ("metrale_model_engine.wire", "U32_TYPECODE"),
    }
    _REPLACED = {
        "WireEp": "subclass LinkedEp and hold an EpLink in self.ep_link (see the README, 'Writing a multi-rank model')",
        "Broadcast": "transports now send and receive whole messages: see metrale_model_engine.transport.EpTransport",
        "INLINE_TOKENS": "items carry any number of tokens: see metrale_model_engine.wire",
    }

    def __getattr__(name: str) -> object:
        """The names this release renamed (with a ``DeprecationWarning``) or replaced (with the way)."""
        if name in _RENAMED:
            home, new = _RENAMED[name]
            warnings.warn(
                f"metrale_model_engine.{name} is now {home}.{new}; the old name goes in 0.3",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(home), new)
        if name in _REPLACED:
            raise AttributeError(f"metrale_model_engine.{name} was replaced: {_REPLACED[name]}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
