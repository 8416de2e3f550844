"""The real S3 server every ``--s3`` benchmark runs against, with its remote profiles.

``loopback``: SeaweedFS's S3 gateway on 127.0.0.1 as it is (the tests' fixture).
``far``: the same server behind :mod:`bench.common.latency_proxy`, 20 ms more per request
(and per new connection), over real HTTP. Every client in a benchmark (boto3, s3fs,
obstore, the peers' own) is pointed at :attr:`S3Remote.endpoint_url`, so each pays the
same network.
"""

from __future__ import annotations

from typing import Any

from bench.common.latency_proxy import LatencyProxy
from bench.common.proc_cpu import process_cpu_seconds
from tests.s3server import CREDENTIALS, S3Server

PROFILES = {"loopback": 0.0, "far": 20.0}
"""Remote profiles by name: milliseconds added to each request."""


class S3Remote:
    """A running server, optionally behind the delay line; ``close()`` stops both."""

    def __init__(
        self, latency_ms: float = 0.0, server: S3Server | None = None, volume_max: int = 300
    ) -> None:
        """``volume_max``: room of a server started here (``S3Server``'s, in 64 MB volumes)."""
        self._owns_server = server is None
        self.server = server or S3Server(volume_max=volume_max)
        self.latency_ms = latency_ms
        self.proxy = LatencyProxy(self.server.endpoint_url, latency_ms) if latency_ms else None
        self.endpoint_url = self.proxy.endpoint_url if self.proxy else self.server.endpoint_url

    @classmethod
    def profile(cls, name: str, server: S3Server | None = None, volume_max: int = 300) -> S3Remote:
        if name not in PROFILES:
            raise ValueError(f"unknown remote profile {name!r}: one of {sorted(PROFILES)}")
        return cls(PROFILES[name], server, volume_max)

    def describe(self) -> str:
        where = f"SeaweedFS S3 on loopback ({self.server.endpoint_url})"
        if self.proxy:
            return f"{where} behind a user-space delay line, +{self.latency_ms:g} ms/request"
        return where

    @property
    def storage_options(self) -> dict[str, Any]:
        """For ``ub.open_store("s3://...", **options)`` (native or fsspec backend)."""
        return {**self.server.storage_options, "endpoint_url": self.endpoint_url}

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client through this profile (``config``: botocore Config kwargs)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=CREDENTIALS["key"],
            aws_secret_access_key=CREDENTIALS["secret"],
            region_name="us-east-1",
            config=Config(**config) if config else None,
        )

    def new_root(self) -> str:
        """``bucket/folder``, empty, in the server's bucket."""
        return self.server.new_root()

    def proxy_cpu_seconds(self) -> float:
        """CPU the delay line has used so far (0 on loopback): the shaping's own cost."""
        return self.proxy.cpu_seconds() if self.proxy else 0.0

    def server_cpu_seconds(self) -> float:
        """CPU the S3 server has used so far (shared by every profile on it)."""
        return process_cpu_seconds(self.server.proc.pid)

    def close(self) -> None:
        if self.proxy:
            self.proxy.close()
        if self._owns_server:
            self.server.close()

    def __enter__(self) -> S3Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
