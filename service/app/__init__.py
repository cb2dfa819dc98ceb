"""The FastAPI service: the app (``server.create_app``, ``server.serve``), dependencies, the one error
mapping to HTTP, middleware, observability and the routes."""
