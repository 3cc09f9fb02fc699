"""Test kits for code built on hetccl: the transport conformance checks (transport_conformance)."""
