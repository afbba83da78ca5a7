"""kvrouter: a KV-cache-aware request router for vLLM fleets.

Pure parts (shared by the live gateway and the simulator): routing policies and load accounting.
I/O shells: the aiohttp gateway, upstream proxy, health checks; ``kvrouter.lab.sim`` (simulated vLLM fleet
and trace-driven evaluation).
"""

__version__ = "0.1.0"
