"""The torch.distributed backend: ``TorchTransport``, group setup and launch, the transport choice,
``Collectives`` (public: ``metrale_model_engine.torch``).  Imports torch."""
