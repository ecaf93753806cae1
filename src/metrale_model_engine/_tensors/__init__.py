"""What a model's tensors need of the protocol: ``Collectives`` (its all-reduces inside the run's
contract), ``tensor_tokens`` (a tensor as a token array) and ``count_ops`` (what one call costs a
device) (public: ``metrale_model_engine.torch`` and ``metrale_model_engine.reference``).  Imports torch."""
