"""The store contract runs on every backend, S3 through s3fs and Azure Blob included."""

from __future__ import annotations

import pytest

from tests.conftest import STORE_BACKENDS, make_store_url
from unbroken import open_store
from unbroken.storage import Store


@pytest.fixture(params=STORE_BACKENDS)
def store(request, tmp_path, s3_server_lazy) -> Store:
    """An empty store on each backend: a local path, memory://, S3 on loopback
    (SeaweedFS) through the native backend and through s3fs, Azure Blob on Azurite."""
    url, options = make_store_url(request.param, tmp_path, s3_server_lazy)
    return open_store(url, **options)
