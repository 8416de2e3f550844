"""What storage_options mean to the native backend (s3, gcs, azure): pure mapping."""

from __future__ import annotations

import pytest

import unbroken as ub
from unbroken.storage.native_options import native_kind, native_target


def test_urls_pick_the_native_backend_and_others_keep_fsspec():
    assert native_kind("s3://b/p") == "s3"
    assert native_kind("gs://b/p") == native_kind("gcs://b") == "gcs"
    assert native_kind("az://c/p") == native_kind("abfs://c@acct.dfs.core.windows.net/p")
    assert native_kind("memory://x") is None and native_kind("/local/path") is None
    assert type(ub.open_store("memory://x-native-kind")).__name__ == "FsspecStore"


def test_s3fs_names_map_to_native_keys():
    t = native_target(
        "s3://bucket/run/ckpt",
        {
            "key": "AK",
            "secret": "SK",
            "token": "ST",
            "endpoint_url": "http://127.0.0.1:9000",
            "client_kwargs": {"region_name": "eu-west-1"},
            "skip_instance_cache": True,
        },
    )
    assert (t.kind, t.bucket, t.prefix) == ("s3", "bucket", "run/ckpt")
    assert t.config == {
        "access_key_id": "AK",
        "secret_access_key": "SK",
        "session_token": "ST",
        "endpoint": "http://127.0.0.1:9000",
        "region": "eu-west-1",
    }
    assert t.client_options == {"allow_http": True}  # a plain-HTTP endpoint was asked for


def test_anonymous_and_client_options():
    t = native_target("gs://pub/data", {"anon": True, "client_options": {"timeout": "30s"}})
    assert t.config == {"skip_signature": True}
    assert t.client_options == {"timeout": "30s"}
    assert native_target("s3://b", {"anon": False}).config == {}


def test_azure_account_from_the_url_and_a_connection_string():
    t = native_target("abfs://container@myacct.dfs.core.windows.net/p", {"account_key": "K"})
    assert (t.bucket, t.prefix) == ("container", "p")
    assert t.config == {"account_name": "myacct", "account_key": "K"}
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
        "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
    )
    t = native_target("az://c/x", {"connection_string": conn})
    assert t.config == {
        "account_name": "devstoreaccount1",
        "account_key": "a2V5",
        "endpoint": "http://127.0.0.1:10000/devstoreaccount1",
    }
    assert t.client_options == {"allow_http": True}


@pytest.mark.parametrize(
    "url,options,bad",
    [
        ("s3://b/p", {"endpiont_url": "http://x"}, "endpiont_url"),
        ("gs://b/p", {"region": "us"}, "region"),
        ("az://c/p", {"client_options": {"timeot": 1}}, "timeot"),
    ],
)
def test_an_unknown_option_is_refused_by_name(url, options, bad):
    with pytest.raises(ValueError, match=bad) as err:
        ub.open_store(url, **options)
    assert "backend='fsspec'" in str(err.value) or "known" in str(err.value)


def test_the_backend_option(tmp_path):
    with pytest.raises(ValueError, match="backend must be"):
        ub.open_store("s3://b/p", backend="boto")
    store = ub.open_store("s3://b/p", backend="fsspec", anon=True)
    assert type(store).__name__ == "FsspecStore"
    store = ub.open_store("s3://b/p", anon=True, region="us-east-1")
    assert type(store).__name__ == "NativeStore"
