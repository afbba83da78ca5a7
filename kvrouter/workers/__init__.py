"""Several gateway processes on one host (``kvrouter serve --workers N``): the supervisor that forks them
after loading what they share, and the wiring of each worker to the host's shared state (``kvrouter.host``).

::

    supervisor.py   Supervisor, shared_host, preload: fork N workers, replace the dead, stop on signals
    wiring.py       WorkerHost (a worker's share of the host, for Gateway), RingSync (speculative entries)
"""

from .supervisor import Supervisor, preload, shared_host
from .wiring import RingSync, WorkerHost

__all__ = ["RingSync", "Supervisor", "WorkerHost", "preload", "shared_host"]
