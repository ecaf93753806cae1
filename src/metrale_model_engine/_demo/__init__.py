"""The demo program's private parts, shared with the HTTP server: ``args`` (the command line and the model's
options), ``choices`` (device, backend, threads, checkpoint, memory and prompt, each chosen or checked once) and
``launch`` (the ranks started, under torchrun or as local processes, and one exit status)."""
