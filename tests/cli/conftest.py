from tests.sdk.conftest import api_server, auth_server, ray_service_url  # noqa: F401 (fixtures)
