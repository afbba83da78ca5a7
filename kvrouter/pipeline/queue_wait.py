"""How long a request that starts waiting now would wait: learnt from the waits the capacity gate has seen.

A waiter's wait is roughly the places it enters at (the waiters ranked ahead of it, plus itself) times
the time the fleet takes to free one place.  ``WaitEstimate`` keeps a moving average of that time per
place, from every wait that ended: a grant gives its wait, a timeout a lower bound of it (the timeout
itself), which only ever raises the estimate, as it should once waiters time out.

A request expected to wait past the queue's timeout is refused at once (``CapacityGate``): it would be
refused anyway, one timeout later, holding its connection and its place while it waits.  So under a
fleet-bound overload the queue settles where the expected wait meets the timeout, and the requests
beyond get a prompt 429 instead of a late one.

Invariants: no estimate until ``min_samples`` waits have ended (a cold gate never refuses early); the
estimate forgets with ``alpha`` per observed wait, so a fleet that speeds up is believed within a few
dozen waits; a place never costs less than zero."""

from __future__ import annotations


class WaitEstimate:
    __slots__ = ("alpha", "min_samples", "per_place", "samples")

    def __init__(self, alpha: float = 0.1, min_samples: int = 8) -> None:
        if not 0.0 < alpha <= 1.0 or min_samples < 1:
            raise ValueError("alpha must be in (0, 1] and min_samples >= 1")
        self.alpha = alpha
        self.min_samples = min_samples
        self.per_place = 0.0
        """Seconds one place in the queue costs a waiter (moving average)."""
        self.samples = 0

    def observe(self, waited_s: float, places: int) -> None:
        """A wait ended after ``waited_s``; the waiter had entered at ``places`` (itself included)."""
        if places < 1 or waited_s < 0.0:
            return
        x = waited_s / places
        self.samples += 1
        if self.samples == 1:
            self.per_place = x
        else:
            # The first samples weigh as a plain mean would, so a few early waits do not dominate.
            a = max(self.alpha, 1.0 / self.samples)
            self.per_place += a * (x - self.per_place)

    def expected(self, places: int) -> float | None:
        """The wait expected for a waiter entering at ``places``; None while too few waits have ended."""
        if self.samples < self.min_samples:
            return None
        return self.per_place * places
