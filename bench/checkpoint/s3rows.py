"""The rows of bench/peers/checkpoints.py: bench/checkpoint/saves.py's ways of saving, over real S3.

Each row here is a row of :mod:`bench.checkpoint.rows` (same training loop, same
measurements in :func:`bench.checkpoint.job.run_row`) whose bytes go to the real S3
server of :mod:`bench.common.s3remote`
instead of the emulated remote, through the client a user of that tool would use:

- ``torch.save`` on rank 0 of the gathered full state, uploaded with boto3's
  ``upload_file`` (multipart, 10 threads), restored with ``download_file``;
- ``dcp.save`` / ``dcp.async_save`` with s3torchconnector's ``S3StorageWriter`` (AWS's
  own DCP writer, the CRT's multipart client) or torch's ``FsspecWriter`` over s3fs;
- ``unbroken.CheckpointManager`` with an ``s3://`` durable tier (its native backend).

Importing this module registers the rows in :data:`bench.checkpoint.job.ROW_CLASSES`, and
:class:`S3Config` is defined here, so a spawned rank that unpickles its config has the
rows too. The peers' clients are configured the way their users do it: the standard AWS
environment (``AWS_ENDPOINT_URL``, keys, region), which the parent sets (:func:`aws_env`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from bench.checkpoint.job import ROW_CLASSES, ROW_TITLES, Config
from bench.checkpoint.rows import (
    DcpAsyncBest,
    DcpSave,
    Row,
    RowContext,
    TorchSaveRank0,
    Unbroken,
    load_sharded_state,
    sharded_state,
)

REGION = "us-east-1"


@dataclasses.dataclass
class S3Config(Config):
    """bench/checkpoint/saves.py's run config, plus where the S3 rows put their bytes."""

    s3_root: str = ""
    """``bucket/folder`` in the benchmark's server; each row writes under ``<root>/<row>``."""
    s3_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Storage options of the remote profile (endpoint, keys): unbroken's, and s3fs's."""
    profile: str = "loopback"
    """The remote profile's name (reported only)."""

    @property
    def remote_options(self) -> dict[str, Any]:
        return {"s3_root": self.s3_root, "s3_options": self.s3_options}


def aws_env(endpoint_url: str, key: str, secret: str) -> dict[str, str]:
    """The environment a user sets so boto3 and s3torchconnector reach this server."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
    }


@dataclasses.dataclass
class S3RowContext(RowContext):
    """A row's context with its durable tier at ``s3://<root>/<row key>``."""

    s3_root: str = ""

    @classmethod
    def of(cls, ctx: RowContext) -> S3RowContext:
        if isinstance(ctx, cls):
            return ctx
        fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(RowContext)}
        opts = ctx.remote_options
        fields["remote_options"] = dict(opts["s3_options"])  # what unbroken's manager gets
        return cls(**fields, s3_root=opts["s3_root"])

    @property
    def store_url(self) -> str:
        return f"s3://{self.s3_root}/{os.path.basename(self.row_dir)}"

    def fs_options(self) -> dict[str, Any]:
        """s3fs's options (FsspecWriter / FsspecReader)."""
        return dict(self.remote_options)


def s3_client() -> Any:
    """A boto3 client from the environment, as a user's script makes one."""
    import boto3

    return boto3.client("s3")


def split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def delete_prefix(url: str) -> int:
    """Delete every object under ``url``; returns how many."""
    client = s3_client()
    bucket, prefix = split_url(url)
    deleted = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    return deleted


class OnS3(Row):
    """Mixin: the row's URLs are in its S3 prefix, and pruning deletes S3 objects."""

    def __init__(self, ctx: RowContext) -> None:
        super().__init__(S3RowContext.of(ctx))

    def _url(self, step: int, suffix: str = "") -> str:
        return f"{self.ctx.store_url}/step-{step:09d}{suffix}"

    def _prune(self, keep: int = 2) -> None:
        while len(self.saved_steps) > keep:
            old = self.saved_steps.pop(0)
            if self.ctx.rank == 0:
                delete_prefix(self._url(old))


class S3TorchSave(OnS3, TorchSaveRank0):
    """Rank 0 gathers the full state, ``torch.save``s it to a local file and uploads it
    with boto3 (what most training scripts do); the other ranks wait at a barrier."""

    key, title = "s3_torch_save", "torch.save rank 0 + boto3"

    def _write_full(self, step: int, full: dict[str, Any]) -> None:
        bucket, key = split_url(self._url(step, ".pt"))
        os.makedirs(self.ctx.work_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.ctx.work_dir, suffix=".pt") as f:
            torch.save(full, f)
            f.flush()
            s3_client().upload_file(f.name, bucket, key)

    def _read_full(self, step: int) -> dict[str, Any]:
        bucket, key = split_url(self._url(step, ".pt"))
        os.makedirs(self.ctx.work_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.ctx.work_dir, suffix=".pt") as f:
            s3_client().download_file(bucket, key, f.name)
            return torch.load(f.name, map_location="cpu", weights_only=True)


def region() -> str:
    return os.environ.get("AWS_REGION", REGION)


class ViaS3Connector(OnS3, DcpSave):
    """Mixin: DCP's storage is s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader``
    (path-style requests: the server is not on a bucket-per-host domain)."""

    def _connector_config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True)

    def writer(self, step: int) -> Any:
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(region(), self._url(step), s3client_config=self._connector_config())

    def restore_durable(self) -> bool:
        from s3torchconnector.dcp import S3StorageReader

        sd = sharded_state(self.ctx)
        reader = S3StorageReader(
            region(),
            self._url(self.saved_steps[-1]),
            s3client_config=self._connector_config(),
        )
        dcp.load(sd, storage_reader=reader)
        load_sharded_state(self.ctx, sd)
        return True


class S3DcpSave(ViaS3Connector):
    key, title = "s3_dcp_save", "dcp.save (s3torchconnector)"


class S3DcpAsync(ViaS3Connector, DcpAsyncBest):
    """``dcp.async_save`` with bench/checkpoint/saves.py's best options (one long-lived
    shared-memory stager, the persistent checkpoint process) and s3torchconnector."""

    key, title = "s3_dcp_async", "dcp.async_save (s3torchconnector)"


class S3DcpSaveFsspec(OnS3, DcpSave):
    """``dcp.save`` with torch's own ``FsspecWriter`` over s3fs: the other S3 writer a DCP
    user has, to show which of the two the async row should use."""

    key, title = "s3_dcp_save_fsspec", "dcp.save (FsspecWriter, s3fs)"


class S3Unbroken(OnS3, Unbroken):
    """``unbroken.CheckpointManager("s3://...")``: the staging tier on local disk, the
    durable tier on the server through unbroken's native (obstore) backend."""

    key, title = "s3_unbroken", "unbroken"


class S3UnbrokenThreads(S3Unbroken):
    """unbroken with its uploads on threads of the training process (``save_helper=False``),
    beside the default, whose save helper uploads from a process of its own."""

    key, title = "s3_unbroken_threads", "unbroken, uploads on threads"

    def _manager_options(self) -> dict[str, Any]:
        return {"save_helper": False}


class S3UnbrokenDisk(S3Unbroken):
    """unbroken with the node's copy on the staging disk (``memory_tier=False``): the
    restore from the node then reads the disk tier instead of the memory tier."""

    key, title = "s3_unbroken_disk", "unbroken, disk tier"

    def _manager_options(self) -> dict[str, Any]:
        return {"memory_tier": False}


S3_ROWS: list[type[Row]] = [
    S3TorchSave, S3DcpSave, S3DcpAsync, S3DcpSaveFsspec, S3Unbroken, S3UnbrokenThreads,
    S3UnbrokenDisk,
]  # fmt: skip
ROW_CLASSES.update({cls.key: cls for cls in S3_ROWS})
ROW_TITLES.update({cls.key: cls.title for cls in S3_ROWS})
