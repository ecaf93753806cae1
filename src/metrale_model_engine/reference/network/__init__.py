"""The network, Mixtral's and Qwen3-MoE's arithmetic sharded over the ranks: ``layers`` (norms, rotary positions,
the attention over the paged KV cache), ``experts`` (``ShardedMoe``: the router and the experts this rank holds),
``model`` (``ShardedLm``: the blocks, the embedding and the LM head) and ``graphs`` (``DecodeGraphs``: decode steps
replayed from CUDA graphs).  Its shape is ``config``'s; it knows nothing of the protocol."""
