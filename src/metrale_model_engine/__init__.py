"""metrale-model-engine: the ``ModelEp`` head/worker command protocol of Metrale, typed.

Rank 0, the head, runs the scheduler and, before each model operation, broadcasts
a command header (``ep_broadcast_cmd_for_seq``) and its follow-ups
(``ep_broadcast_cmd``, ``ep_broadcast_tokens``); every other rank, a worker, loops
on ``ep_worker_step`` (or :func:`run_worker`), which receives the header and runs
the command in ``slots[seq_id]``, reading the follow-ups with ``ep_recv_word`` and
``ep_recv_tokens``.  :class:`ModelEp` is the trait with single-GPU defaults;
:class:`WireEp` implements it over any :class:`EpTransport`.

Importing this package never imports torch; the torch.distributed backend lives in
:mod:`metrale_model_engine.torch` (extra ``torch``).
"""

from . import _errors
from ._errors import *  # noqa: F403  (the exception classes, as listed in _errors.__all__)
from ._frame import FRAME_WORDS, INLINE_TOKENS, FrameKind
from ._model import ModelEp
from ._protocol import PROTOCOL_ENV_VAR, EpProtocol
from ._state import SequenceState
from ._tokens import U32_TYPECODE, ArrayInterface, TokenArray, as_u32_buffer
from ._transport import Broadcast, EpTransport
from ._wire import DEFAULT_COMMAND_TIMEOUT, WIRE_VERSION, WireEp, check_slot
from ._words import CMD_SHUTDOWN, U32_MAX, U32_MIN, check_u32
from ._worker import WorkerSummary, run_worker

__all__ = [
    "CMD_SHUTDOWN",
    "DEFAULT_COMMAND_TIMEOUT",
    "FRAME_WORDS",
    "INLINE_TOKENS",
    "PROTOCOL_ENV_VAR",
    "U32_MAX",
    "U32_MIN",
    "U32_TYPECODE",
    "WIRE_VERSION",
    "ArrayInterface",
    "Broadcast",
    "EpProtocol",
    "EpTransport",
    "FrameKind",
    "ModelEp",
    "SequenceState",
    "TokenArray",
    "WireEp",
    "WorkerSummary",
    "as_u32_buffer",
    "check_slot",
    "check_u32",
    "run_worker",
]

__all__ += _errors.__all__

__version__ = "0.1.0"
