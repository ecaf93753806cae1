"""How one command of the reference model travels, at both ends: ``words`` (the command words and each one's wire
layout, one send/receive pair that the head and the workers share), ``head`` (``HeadCommands``: check, take the
blocks it needs, send, then the same forward as the workers) and ``worker`` (``WorkerHook``: receive, check,
forward)."""
