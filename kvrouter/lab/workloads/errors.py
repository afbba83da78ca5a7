"""Errors and warnings of the workload layer.

::

    WorkloadError                     base of everything raised here
    ├── UnknownWorkload (LookupError) no generator registered under that name
    ├── InvalidParameters (ValueError)parameters that fail validation (unknown field, wrong type, bad value)
    ├── TraceFormatError (ValueError) a trace line that does not follow the Mooncake format
    └── NotMaterialized               token ids asked of a text-only request before ``materialize``

    ChecksumMismatch (UserWarning)    a shipped trace file whose sha256 differs from the published one
"""

from __future__ import annotations


class WorkloadError(Exception):
    """Base class of the errors raised by ``kvrouter.lab.workloads``."""


class UnknownWorkload(WorkloadError, LookupError):
    """``make_workload`` was given a name that is not in the registry."""


class InvalidParameters(WorkloadError, ValueError):
    """Generator parameters that do not validate."""


class TraceFormatError(WorkloadError, ValueError):
    """A trace that does not follow the expected format; the message names the line."""


class NotMaterialized(WorkloadError):
    """A request carries text or chat messages only: run ``materialize`` with a tokenizer first."""


class ChecksumMismatch(UserWarning):
    """A shipped trace file differs from the one the published figures were computed on."""
