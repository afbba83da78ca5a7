"""What every Kubernetes object and list shares, as discovery reads it (pure: no I/O).

Field names follow the API's JSON (camelCase on the wire, snake_case here); fields discovery does not read
are ignored on decoding.  Every field has a default: a BOOKMARK's object is the watched type's zero value
with only ``metadata.resourceVersion`` set, and must decode as the type itself.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import msgspec


class ObjectMeta(msgspec.Struct, frozen=True, rename="camel"):
    name: str = ""
    """Object name (unique per namespace and kind)."""
    namespace: str = ""
    resource_version: str = ""
    """Opaque version of this object (for a BOOKMARK: of the whole collection)."""
    labels: dict[str, str] | None = None
    """Slices carry their Service's labels plus ``kubernetes.io/service-name``; pods their own."""
    annotations: dict[str, str] | None = None
    deletion_timestamp: str | None = None
    """Set once the object is being deleted (a pod then leaves rotation, even if still ready)."""

    @property
    def resourceVersion(self) -> str:
        """The API's own spelling, read by the Kubernetes client as each watch event arrives."""
        return self.resource_version


class ListMeta(msgspec.Struct, frozen=True, rename="camel"):
    resource_version: str = ""
    """The collection's version at the time of the list: where the watch starts."""
    continue_: str | None = msgspec.field(default=None, name="continue")
    """Token for the next page; absent or empty on the last."""


class Status(msgspec.Struct, frozen=True):
    """The API's error object: a non-2xx body, or the object of a watch ERROR event."""

    code: int = 0
    """HTTP-like code: 410 for an expired resourceVersion."""
    reason: str = ""
    """Machine-readable: ``Expired``, ``Gone``, ``Unauthorized``..."""
    message: str = ""


class WatchEvent(msgspec.Struct, frozen=True):
    type: str
    """ADDED, MODIFIED, DELETED, BOOKMARK or ERROR."""
    object: msgspec.Raw
    """The watched object (a BOOKMARK's holds only metadata.resourceVersion) or, for ERROR, a Status."""


class Named(Protocol):
    @property
    def metadata(self) -> ObjectMeta: ...


T = TypeVar("T", bound=Named)


class ObjectCache(Generic[T]):
    """The watched objects by name, and the collection's resourceVersion to resume the watch from.

    Invariant: ``objects`` is the API server's state of the selection as of ``resource_version`` (a list
    replaces it whole; each watch event moves it one change on)."""

    def __init__(self) -> None:
        self.objects: dict[str, T] = {}
        self.resource_version: str = ""

    def replace(self, items: list[T], resource_version: str) -> None:
        """A (re)list: the items are the whole truth as of ``resource_version``."""
        self.objects = {o.metadata.name: o for o in items}
        self.resource_version = resource_version

    def apply(self, kind: str, obj: T) -> bool:
        """One watch event; True if the objects changed (a BOOKMARK only moves the version)."""
        if obj.metadata.resource_version:
            self.resource_version = obj.metadata.resource_version
        name = obj.metadata.name
        if kind in ("ADDED", "MODIFIED"):
            self.objects[name] = obj
            return True
        if kind == "DELETED":
            return self.objects.pop(name, None) is not None
        return False
