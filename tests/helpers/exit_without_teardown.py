"""A rank program that never calls destroy_process_group: its exit must still be clean.

Run as ``python tests/helpers/exit_without_teardown.py`` with torchrun's env:// variables set.
"""

from metrale_model_engine import EpLink, ProtocolVersion, run_worker
from metrale_model_engine.torch import TorchTransport, init_group_from_env
from metrale_model_engine.toy import ToyModel, ToyState

init_group_from_env(backend="gloo")  # its ranks meet as soon as rank 0 listens
model = ToyModel(EpLink(TorchTransport(), num_slots=2, protocol=ProtocolVersion.V2, command_timeout=20))
slots: list[ToyState | None] = [None, None]
if model.ep_link.rank == 0:
    model.alloc(slots, 1)
    model.prefill(slots, 1, list(range(30)))
    model.decode(slots, 1)
    model.ep_link.shutdown_workers()  # and no close, no destroy_process_group: the exit hook's job
else:
    run_worker(model, slots)
