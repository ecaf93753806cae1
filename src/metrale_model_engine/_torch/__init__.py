"""The torch.distributed backend: ``TorchTransport`` (framed broadcasts), ``HostsTransport`` (a leader per
host), the workers' heartbeat and the head's watch of it, answers through the group's store, and the
severing of a group's waits (public: ``metrale_model_engine.torch``).  Imports torch."""
