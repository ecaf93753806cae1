"""The shared-memory backend: a segment, a ring the head writes and the workers read, answer rings,
futex waits; ``ShmTransport`` and ``run_ring`` (public: ``metrale_model_engine.shm``).  No torch."""
