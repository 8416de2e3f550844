"""Fixtures every test package shares: the loopback S3 server and a store per backend."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from unbroken import open_store
from unbroken.storage import Store

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

BACKENDS = ["local", "memory", "s3"]
STORE_BACKENDS = [*BACKENDS, "s3-fsspec", "azure"]
"""The store contract's (tests/storage/): S3 through both backends (native obstore, and
s3fs), and Azure Blob on Azurite (skipped where `make install` found no npm for it)."""


@pytest.fixture(scope="session", autouse=True)
def _discard_test_links():
    """Emulated links made up by this session's tests leave no state file behind."""
    from tests.link_names import discard_links

    yield
    discard_links()


@pytest.fixture(autouse=True)
def _memory_tier_of_its_own(tmp_path_factory, monkeypatch):
    """Each test's checkpoint memory tier lives in a directory of its own (its ranks'
    processes inherit it), not in the machine's /dev/shm: a test that ends without
    close() leaves nothing there, and no test sweeps another's. Tests of the tier on a
    real tmpfs set UNBROKEN_MEMORY_DIR themselves."""
    monkeypatch.setenv("UNBROKEN_MEMORY_DIR", str(tmp_path_factory.mktemp("shm")))


@pytest.fixture(scope="session")
def s3_server():
    """SeaweedFS's S3 gateway on loopback, for the whole session; SIGKILLed at its end
    (and by the kernel if this process dies first)."""
    from tests.s3server import S3Server

    server = S3Server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def azurite_server():
    """Azurite's Blob service on loopback, for the whole session."""
    from tests.s3server import AzuriteServer, azurite_binary

    binary = azurite_binary()
    if binary is None:
        pytest.skip("Azurite is not installed (make install brings it with npm)")
    server = AzuriteServer(binary)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def store_url(request, tmp_path, s3_server_lazy) -> tuple[str, dict]:
    """(url, storage_options) of an empty store on the backend named by the param."""
    return make_store_url(request.param, tmp_path, s3_server_lazy)


@pytest.fixture(scope="session")
def s3_server_lazy(request):
    """The S3 server, started only when a test actually asks for the s3 backend."""

    class Lazy:
        server = None

        def get(self):
            if self.server is None:
                self.server = request.getfixturevalue("s3_server")
            return self.server

        def azurite(self):
            return request.getfixturevalue("azurite_server")

    return Lazy()


def make_store_url(backend: str, tmp_path, lazy) -> tuple[str, dict]:
    if backend == "local":
        return str(tmp_path / "store"), {}
    if backend == "memory":
        return f"memory://unbroken-test-{uuid.uuid4().hex[:10]}", {}
    if backend in ("s3", "s3-fsspec"):
        server = lazy.get()
        options = dict(server.storage_options)
        if backend == "s3-fsspec":
            options["backend"] = "fsspec"
        return f"s3://{server.new_root()}/prefix", options
    if backend == "azure":
        server = lazy.azurite()
        return f"az://{server.new_root()}", server.storage_options
    raise ValueError(backend)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path, s3_server_lazy) -> Store:
    """An empty store on each backend: a local path, memory:// and S3 on loopback
    (SeaweedFS). tests/storage/ widens it to STORE_BACKENDS."""
    url, options = make_store_url(request.param, tmp_path, s3_server_lazy)
    return open_store(url, **options)


@pytest.fixture(autouse=True)
def _sigterm_handler_restored():
    """A test that leaves a CheckpointManager open leaves its SIGTERM handler installed;
    put the one from before back, so no test inherits another's preemption state."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)
