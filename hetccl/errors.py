"""Exceptions raised by hetccl. Every one says what went wrong and what to do about it."""

from __future__ import annotations


class HetcclError(RuntimeError):
    """Base class of every error hetccl raises on purpose."""


class ConfigError(HetcclError, ValueError):
    """Bad configuration or bad arguments (missing env variable, wrong buffer, unknown op...)."""


class CollectiveTimeout(HetcclError, TimeoutError):
    """A wait ran past its deadline (HETCCL_TIMEOUT); a peer is stuck or never arrived."""


class PeerLostError(HetcclError, ConnectionError):
    """A peer closed its connection or died; `.rank` is the lost rank (-1 when unknown)."""

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank


class CollectiveMismatchError(HetcclError):
    """Ranks issued different collectives (op, dtype, count, root, reduce op or order)."""


class CommAbortedError(HetcclError):
    """The communicator was aborted (`comm.abort()`); create a new one, or `shrink()` another."""


class AuthenticationError(HetcclError, PermissionError):
    """A connection failed the job-secret HMAC challenge."""


class TransportError(HetcclError):
    """A transport failed or is unavailable (the message says which and why)."""


class TransportVersionError(ConfigError):
    """A transport plugin implements an interface version this hetccl does not speak (the message says what
    to change)."""


class ProtocolError(HetcclError):
    """A peer sent a malformed frame (bad magic, bad length, undecodable payload)."""


__all__ = [
    "HetcclError",
    "ConfigError",
    "CollectiveTimeout",
    "PeerLostError",
    "CollectiveMismatchError",
    "CommAbortedError",
    "AuthenticationError",
    "TransportError",
    "ProtocolError",
    "TransportVersionError",
]
