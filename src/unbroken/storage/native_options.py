"""What an object store URL and its ``storage_options`` mean to the native backend.

Pure: no I/O, no obstore import. Users already write s3fs / gcsfs / adlfs option names
(``endpoint_url``, ``key``, ``secret``, ``anon``, ``client_kwargs``); those are mapped to
the Rust ``object_store`` configuration keys, the native keys are taken as they are, and
anything else is refused with the list of what is understood, so a typo never falls
back silently to credentials from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from unbroken.storage.errors import redact

NATIVE_SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}
"""URL scheme -> the native backend's kind."""

_NATIVE_KEYS = {
    # obstore's S3Config, GCSConfig and AzureConfig keys, taken as they are.
    "s3": {
        "access_key_id", "secret_access_key", "session_token", "region", "default_region",
        "endpoint", "bucket", "checksum_algorithm", "conditional_put", "copy_if_not_exists",
        "container_credentials_relative_uri", "container_credentials_full_uri",
        "container_authorization_token_file", "disable_tagging", "disable_bulk_delete",
        "metadata_endpoint", "request_payer", "role_arn", "role_session_name",
        "server_side_encryption", "skip_signature", "sse_bucket_key_enabled",
        "sse_kms_key_id", "sts_endpoint", "unsigned_payload", "virtual_hosted_style_request",
        "web_identity_token_file",
    },
    "gcs": {
        "service_account", "service_account_key", "base_url", "bearer_token",
        "application_credentials", "skip_signature",
    },
    "azure": {
        "account_name", "account_key", "client_id", "client_secret", "credential_type",
        "tenant_id", "authority_host", "sas_key", "token", "use_emulator",
        "use_fabric_endpoint", "encryption_key", "endpoint", "msi_endpoint", "object_id",
        "msi_resource_id", "federated_token_file", "use_azure_cli", "skip_signature",
        "disable_tagging",
    },
}  # fmt: skip

_ALIASES = {
    # fsspec-family names -> native keys, per kind.
    "s3": {
        "endpoint_url": "endpoint",
        "region_name": "region",
        "key": "access_key_id",
        "aws_access_key_id": "access_key_id",
        "secret": "secret_access_key",
        "aws_secret_access_key": "secret_access_key",
        "token": "session_token",
        "aws_session_token": "session_token",
    },
    "gcs": {"endpoint_url": "base_url", "endpoint": "base_url"},
    "azure": {
        "endpoint_url": "endpoint",
        "sas_token": "sas_key",
        "credential": "account_key",
    },
}

_ANONYMOUS = ("anon", "anonymous")
"""True: send unsigned requests (public buckets)."""
_FSSPEC_ONLY = ("skip_instance_cache", "use_listings_cache", "listings_expiry_time")
"""fsspec's own cache switches: they mean nothing here and are accepted as no-ops."""
_CLIENT_KEYS = {
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "default_headers", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
    "proxy_ca_certificate", "proxy_excludes", "root_certificate", "randomize_addresses",
    "read_timeout", "timeout", "user_agent",
}  # fmt: skip
"""obstore's ClientConfig keys: given flat or under ``client_options``."""


@dataclass(frozen=True)
class NativeTarget:
    """Everything needed to build one native store: which backend, where, and how."""

    kind: str
    """"s3", "gcs" or "azure"."""
    bucket: str
    """The bucket (S3, GCS) or container (Azure)."""
    prefix: str
    """The path inside the bucket that the store's keys are relative to ('' for none)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Native configuration keys for the backend (credentials, endpoint, region)."""
    client_options: dict[str, Any] = field(default_factory=dict)
    """HTTP client options (allow_http, timeouts, proxy)."""


def native_kind(url: str) -> str | None:
    """The native backend that serves ``url``, or None where fsspec does."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return NATIVE_SCHEMES.get(scheme)


def native_target(url: str, storage_options: dict[str, Any]) -> NativeTarget:
    """Parse ``url`` and map ``storage_options``; ValueError names a key not understood."""
    kind = native_kind(url)
    if kind is None:
        raise ValueError(f"{url!r} is not an s3://, gs:// or az:// URL")
    parts = urlsplit(url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    config: dict[str, Any] = {}
    if kind == "azure" and "@" in bucket:  # abfs://container@account.dfs.core.windows.net
        bucket, host = bucket.split("@", 1)
        config["account_name"] = host.split(".", 1)[0]
    if not bucket:
        raise ValueError(f"{redact(url)!r} names no bucket")
    if "@" in bucket:  # s3://KEY:SECRET@bucket: a bucket name holds no "@"
        raise ValueError(
            f"{redact(url)!r}: credentials in the URL are not read; pass them as storage "
            "options (key=, secret=) or in the environment (AWS_ACCESS_KEY_ID, ...)"
        )
    client: dict[str, Any] = {}
    _map_into(kind, url, dict(storage_options), config, client)
    if kind == "azure" and "connection_string" in config:
        config.update(_parse_connection_string(config.pop("connection_string"), url))
    endpoint = str(config.get("endpoint") or config.get("base_url") or "")
    given = urlsplit(endpoint)
    if endpoint and (given.scheme not in ("http", "https") or not given.netloc):
        raise ValueError(
            f"open_store({url!r}): the endpoint {endpoint!r} is not an http:// or https:// "
            "URL with a host (e.g. http://127.0.0.1:9000)"
        )
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)  # a plain-HTTP endpoint was asked for
    return NativeTarget(kind, bucket, prefix, config, client)


def _map_into(
    kind: str, url: str, options: dict[str, Any], config: dict[str, Any], client: dict[str, Any]
) -> None:
    aliases = _ALIASES[kind]
    native = _NATIVE_KEYS[kind]
    for key, value in options.items():
        if key in _FSSPEC_ONLY:
            continue
        if key in _ANONYMOUS:
            if value:
                config["skip_signature"] = True
        elif key == "client_kwargs":  # s3fs: botocore client arguments
            if not isinstance(value, dict):
                raise ValueError(f"open_store({url!r}): client_kwargs must be a dict")
            _map_into(kind, url, value, config, client)
        elif key == "client_options":
            if not isinstance(value, dict) or set(value) - _CLIENT_KEYS:
                bad = sorted(set(value) - _CLIENT_KEYS) if isinstance(value, dict) else value
                raise ValueError(
                    f"open_store({url!r}): client_options {bad!r} not understood; known: "
                    f"{', '.join(sorted(_CLIENT_KEYS))}"
                )
            client.update(value)
        elif key in _CLIENT_KEYS:
            client[key] = value
        elif key == "connection_string" and kind == "azure":
            config[key] = value
        elif key in aliases or key in native:
            config[aliases.get(key, key)] = value
        else:
            known = sorted(
                set(aliases) | native | set(_ANONYMOUS) | _CLIENT_KEYS
                | {"client_kwargs", "client_options", *_FSSPEC_ONLY}
            )  # fmt: skip
            raise ValueError(
                f"open_store({url!r}): unknown storage option {key!r} for the native {kind} "
                f"backend. Known: {', '.join(known)}. To use the fsspec backend and its "
                f"options instead, pass backend='fsspec'."
            )


def _parse_connection_string(text: str, url: str) -> dict[str, Any]:
    """An Azure connection string's account, key and blob endpoint."""
    fields = dict(
        part.split("=", 1) for part in str(text).split(";") if "=" in part
    )  # fmt: skip
    out: dict[str, Any] = {}
    if "AccountName" in fields:
        out["account_name"] = fields["AccountName"]
    if "AccountKey" in fields:
        out["account_key"] = fields["AccountKey"]
    if "SharedAccessSignature" in fields:
        out["sas_key"] = fields["SharedAccessSignature"]
    if "BlobEndpoint" in fields:
        out["endpoint"] = fields["BlobEndpoint"]
    if not out:
        raise ValueError(f"open_store({url!r}): connection_string has no AccountName")
    return out
