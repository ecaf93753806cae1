"""What one call costs a device: the aten ops it dispatches, and which of them make the host wait.

[`count_ops`][metrale_model_engine.reference.count_ops] runs a call under a ``TorchDispatchMode`` and sorts every aten
op it dispatches into views (a new header over the same memory: nothing launched),
launches (everything else: on CUDA each is at least one kernel or copy), and waits:
the ops whose result the host must read back before it can go on (``nonzero``,
``item``, ``unique``, boolean indexing, a copy from the device to the host, ...).
It counts on any device, so a CPU run finds every op of a step that reads device values
back, and every launch.  What it cannot see from the CPU: a blocking copy from the host
to a GPU (``.to("cuda")`` without ``non_blocking``) and the kernels CUDA picks inside an
op; ``torch.cuda.set_sync_debug_mode("error")`` is the check on CUDA itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_T = TypeVar("_T")

WAITING_OPS: Final[frozenset[str]] = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "item",
        "nonzero",
        "nonzero_numpy",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "equal",
        "allclose",
        "bincount",
        "repeat_interleave",
    }
)
"""Names of the aten ops whose output size or value the host reads back: each waits for the device."""


@dataclass(frozen=True)
class OpCount:
    """The aten ops one call dispatched, by name (``"mm"``, ``"index_put_"``, ...).

    Attributes:
        launches: the ops that are not views: on CUDA each launches work.
        views: the ops that only made views.
        waits: the ops that make the host wait for the device (a subset of ``launches``).
    """

    launches: Mapping[str, int] = field(default_factory=dict)
    views: Mapping[str, int] = field(default_factory=dict)
    waits: Mapping[str, int] = field(default_factory=dict)

    @property
    def launched(self) -> int:
        """How many ops were not views."""
        return sum(self.launches.values())

    @property
    def waited(self) -> int:
        """How many ops made the host wait for the device (0 for a step that a CUDA graph can hold)."""
        return sum(self.waits.values())


def _waits(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether aten op ``name`` with these arguments makes the host wait for the device."""
    if name in WAITING_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        # a boolean index is turned into positions by a nonzero on the device
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "_to_copy":  # a copy from an accelerator to the host
        source, target = args[0], kwargs.get("device")
        return isinstance(source, torch.Tensor) and source.device.type != "cpu" and target == torch.device("cpu")
    if name == "copy_":
        target, source = args[0], args[1]
        return bool(target.device.type == "cpu" and source.device.type != "cpu")
    return False


class _Counting(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.launches: Counter[str] = Counter()
        self.views: Counter[str] = Counter()
        self.waits: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.is_view:
            self.views[name] += 1
        else:
            self.launches[name] += 1
            if _waits(name, args, kwargs):
                self.waits[name] += 1
        return func(*args, **kwargs)


def count_ops(call: Callable[[], _T]) -> tuple[_T, OpCount]:
    """Run ``call()`` and count the aten ops it dispatched; return its result and the count.

    Ops in torch's Python code above the dispatcher (argument checks on Python
    values, ``tensor.tolist()`` of a host tensor) are not ops; ops that other ops
    run inside one kernel are not counted either.  Not thread-safe: count one call
    at a time.
    """
    with _Counting() as mode:
        result = call()
    return result, OpCount(dict(mode.launches), dict(mode.views), dict(mode.waits))
