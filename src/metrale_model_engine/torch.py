"""The protocol over torch.distributed: gloo on CPU, NCCL on CUDA (extra ``torch``).

* [`open_link`][metrale_model_engine.torch.open_link] gives a rank its [`EpLink`][metrale_model_engine.EpLink] over a
  process group, and [`open_transport`][metrale_model_engine.torch.open_transport] the transport underneath, chosen by
  every rank together: shared memory
  ([`ShmTransport`][metrale_model_engine.shm.ShmTransport]) when every rank is on one
  host; across hosts, one broadcast to a leader per remote host, which
  republishes on its host's ring ([`HostsTransport`][metrale_model_engine.torch.HostsTransport]), or, when no host
  holds two ranks, the group's own broadcasts ([`TorchTransport`][metrale_model_engine.torch.TorchTransport]).
* [`init_local_group`][metrale_model_engine.torch.init_local_group] and
[`run_group`][metrale_model_engine.torch.run_group] start a group of N ranks on
  loopback for scripts and tests; [`init_group_from_env`][metrale_model_engine.torch.init_group_from_env] joins the
  group ``torchrun`` describes.
* [`Collectives`][metrale_model_engine.torch.Collectives] runs a model's all-reduces inside the protocol's contract:
  bounded, and a failure stops the run on every rank with a
  [`RunStopped`][metrale_model_engine.RunStopped] that names what the link knows.
* [`tensor_tokens`][metrale_model_engine.torch.tensor_tokens] turns a 1-D integer tensor into a token array.
* ``count_ops``, ``OpCount`` and ``WAITING_OPS`` moved to
  [`metrale_model_engine.reference`][metrale_model_engine.reference], beside the model they measure; their old names
  here still work, with a ``DeprecationWarning``, until 0.3.

Why shared memory by default: each gloo broadcast between two ranks of one host
is a loopback TCP round trip of 150-300 µs, against a few microseconds for the
ring, and a server sends a command per step.  Only commands take that path;
tensors stay wherever the model keeps them.

Timeouts.  A worker waits for the next header as long as its transport allows: over
gloo that is the group's own timeout (the idle limit), which
[`init_local_group`][metrale_model_engine.torch.init_local_group] sets to
[`DEFAULT_IDLE_TIMEOUT`][metrale_model_engine.torch.DEFAULT_IDLE_TIMEOUT] (pass ``timeout=`` to ``init_process_group``
under torchrun).  A command's follow-ups are bounded by the link's ``command_timeout``.  A dead peer closes its sockets,
which gloo reports at once: the other ranks' next receive or send fails with an ``EpLinkError``.

Across hosts.  A cut cable closes nothing: the head's wait on a lost host would last
its ``command_timeout`` or the collective's timeout, and an idle worker's the idle
limit.  So the workers of a [`TorchTransport`][metrale_model_engine.torch.TorchTransport] beat in the group's store
every [`DEFAULT_HEARTBEAT`][metrale_model_engine.torch.DEFAULT_HEARTBEAT] seconds: a failed send or sync point names the
workers whose beat stopped ("no heartbeat from worker rank(s) [...]"); while the head waits
on its group, workers silent for [`DEFAULT_HEAD_LOST_AFTER`][metrale_model_engine.torch.DEFAULT_HEAD_LOST_AFTER] seconds
are lost and the run stops, naming them; and a worker that cannot reach the store (on the head's
host) for as long logs why and exits with [`HEAD_LOST_EXIT_CODE`][metrale_model_engine.torch.HEAD_LOST_EXIT_CODE].  One
bound, both ways.  Both are arguments of [`open_link`][metrale_model_engine.torch.open_link],
[`open_transport`][metrale_model_engine.torch.open_transport] and
[`TorchTransport`][metrale_model_engine.torch.TorchTransport].
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the check: the modules below import it themselves)
except ImportError as _missing:  # pragma: no cover - exercised in a torch-less venv
    raise ImportError(
        f"metrale_model_engine.torch needs PyTorch (import of {_missing.name or 'torch'!r} failed): for the CPU "
        "build, pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, then the 'torch' "
        "extra (pip install -e '.[torch]' in a checkout); the README's Install section says why"
    ) from _missing
try:
    import numpy  # noqa: F401  (torch's tensor/buffer conversions used here need it)
except ImportError as _missing:
    raise ImportError(
        "metrale_model_engine.torch needs numpy (torch's tensor/buffer conversions and "
        "all_gather_object use it): pip install 'metrale-model-engine[torch]' or pip install numpy"
    ) from _missing

import warnings
from typing import TYPE_CHECKING

from ._core.namespace import PublicDir, public_dir
from ._launch.choice import TRANSPORT_KINDS, TransportKind, open_link, open_transport
from ._launch.groups import (
    DEFAULT_IDLE_TIMEOUT,
    cuda_available,
    default_backend,
    free_port,
    init_group_from_env,
    init_local_group,
    run_group,
)
from ._launch.groups import run_local as run_local  # deprecated: kept importable, not in __all__
from ._tensors.collectives import DEFAULT_COLLECTIVE_TIMEOUT, EXIT_GRACE, Collectives
from ._tensors.tokens import tensor_tokens
from ._torch.heartbeat import DEFAULT_HEAD_LOST_AFTER, DEFAULT_HEARTBEAT, HEAD_LOST_EXIT_CODE
from ._torch.hosts import HostsTransport
from ._torch.transport import TorchTransport

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_HEAD_LOST_AFTER",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_IDLE_TIMEOUT",
    "EXIT_GRACE",
    "HEAD_LOST_EXIT_CODE",
    "TRANSPORT_KINDS",
    "Collectives",
    "HostsTransport",
    "TorchTransport",
    "TransportKind",
    "cuda_available",
    "default_backend",
    "free_port",
    "init_group_from_env",
    "init_local_group",
    "open_link",
    "open_transport",
    "run_group",
    "tensor_tokens",
]

__dir__: PublicDir = public_dir(globals(), __all__)


if TYPE_CHECKING:
    from ._tensors.op_count import WAITING_OPS as WAITING_OPS
    from ._tensors.op_count import OpCount as OpCount
    from ._tensors.op_count import count_ops as count_ops
else:
    from ._tensors import op_count as _op_count

    _MOVED = frozenset({"WAITING_OPS", "OpCount", "count_ops"})
    """Names whose home is now ``metrale_model_engine.reference``: kept here, with a warning, until 0.3."""

    def __getattr__(name: str) -> object:
        """The names that moved (with a ``DeprecationWarning``) or were replaced (with the way)."""
        if name in _MOVED:
            warnings.warn(
                f"metrale_model_engine.torch.{name} is now metrale_model_engine.reference.{name}; "
                "the old name goes in 0.3",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(_op_count, name)  # the very objects the reference package exports
        if name == "TorchEp":
            raise AttributeError(
                "metrale_model_engine.torch.TorchEp was replaced: subclass LinkedEp and hold the link that "
                "open_link(num_slots=...) gives, in self.ep_link (see the README, 'Writing a multi-rank model')"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
