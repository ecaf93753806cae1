"""Deprecated name of ``metrale_model_engine.reference.scheduler`` (the continuous-batching ``Server``).

Importing it warns; the name goes in 0.3.  ``metrale_model_engine.reference`` exports the same names.
"""

import warnings

from .._core.namespace import PublicDir, public_dir
from .requests import Completion, FinishReason, Request
from .scheduler import DecodeStep, ServedLm, Server

__all__ = ["Completion", "DecodeStep", "FinishReason", "Request", "ServedLm", "Server"]

warnings.warn(
    "metrale_model_engine.reference.server is now metrale_model_engine.reference.scheduler; the old name goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)


__dir__: PublicDir = public_dir(globals(), __all__)
