"""A simulated vLLM, faithful to vLLM wherever a router can tell, in three parts by job:

::

    engine/       the engine model, pure and clock-free: block pool with prefix caching and KV events
                  (blockpool, kvcache, offload), continuous batching (scheduler), step durations (timing),
                  the facade (engine), vLLM's wire payloads (payload)
    server/       the live simulated vLLM: an aiohttp OpenAI server per instance, its ranks stepping the
                  engine in real time, the ZeroMQ publisher, faults, a whole fleet in one process
    evaluation/   the virtual-time evaluator: a fleet of engines routed by the real Router (``kvrouter
                  eval``), router replicas in virtual time
    errors.py     the simulator's error tree, shared by the three
"""
