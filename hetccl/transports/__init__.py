"""Transports: the versioned interface (base), the registry and the built-in implementations."""

from .base import TRANSPORT_API_VERSION, Endpoint, Transport, TransportContext, TransportProperties

__all__ = ["TRANSPORT_API_VERSION", "Endpoint", "Transport", "TransportContext", "TransportProperties"]
