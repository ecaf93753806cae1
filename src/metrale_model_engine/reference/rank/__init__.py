"""The parts [`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] is composed of, one job each.

What every rank holds: ``slots`` (a slot's sequence, ``LmState``), ``checks`` (what the
head checks before it sends a command and a worker before it runs one), ``digest`` (the
slots' digest that sync points compare) and ``ledger`` (``KvLedger``: the KV cache's
values checked against what was written, for deeper sync points).

How a command travels, in ``commands``: ``words`` (the command words and each one's wire
layout, one send/receive pair for both ends), ``head`` (``HeadCommands``: check, send, then
the same forward as the workers), ``worker`` (``WorkerHook``: receive, check, forward).

What runs the forward: ``runner`` (``LmRunner``: the sharded network on this rank, its KV
cache and the forwards of a checked command), ``reduce`` (``ServedAllReduce``: the
forward's all-reduces inside the protocol's contract) and ``timing`` (``TimeSpent``).

The names a user writes are exported by [`metrale_model_engine.reference`][metrale_model_engine.reference].
"""
