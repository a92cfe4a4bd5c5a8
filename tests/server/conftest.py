"""Fixtures of the server tests (helpers live in ``server_fixtures``): a tiny checkpoint with five PEFT
adapters (session), and a live server over it (per module)."""

from server_fixtures import server, tiny

__all__ = ["server", "tiny"]
