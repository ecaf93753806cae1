"""The trait a model implements: ``ModelEp`` (single-GPU defaults), ``LinkedEp`` (the trait spoken over the
model's ``EpLink``) and ``run_worker``, the loop a worker rank runs on it."""
