"""The protocol's vocabulary, shared by every layer: errors, u32 words, token arrays, the wire codec,
protocol versions, slot state, argument checks and the transport protocol.  No IO; imports nothing
of the package outside this folder."""
