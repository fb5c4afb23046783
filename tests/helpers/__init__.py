"""Shared test helpers (real components built offline, never mocks)."""
