"""HTTP routers. ``api.server`` mounts ``runs`` and, when importable, the optional routers listed in
``api.server.OPTIONAL_ROUTERS`` (plans, sweeps, cluster, ...), all behind authentication."""
