"""Named types of the routing domain."""

from __future__ import annotations

from typing import NewType

InstanceId = NewType("InstanceId", str)
"""An instance's name in the fleet file."""

RequestId = NewType("RequestId", str)
"""The router's id for one request (unique per router process)."""
