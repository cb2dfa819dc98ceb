"""HTTP routers, mounted by ``service.app.server.create_app``: ``runs``, ``plans``, ``sweeps``, ``cluster`` (behind
authentication when it is on) and ``health`` (``/healthz``, open)."""
