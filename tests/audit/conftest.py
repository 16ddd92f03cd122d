"""Shared by the audit tests: every ``httpx.Client`` the audit opens can be sent to an in-process
fake server."""

import pytest


@pytest.fixture
def serve_with(monkeypatch):
    """``serve_with(server)``: from now on every ``httpx.Client`` talks to ``server`` (an httpx
    MockTransport handler); returns ``server``."""
    import httpx

    def install(server):
        real = httpx.Client

        class Client(real):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "transport": httpx.MockTransport(server)})
        monkeypatch.setattr(httpx, "Client", Client)
        return server
    return install
