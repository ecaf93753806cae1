"""Starting ranks and assembling their link: process groups for scripts, tests and torchrun
(``setup_group``, ``run_group``) and the transport every rank chooses together (``open_link("auto")``)
(public: ``metrale_model_engine.torch``).  Imports torch."""
