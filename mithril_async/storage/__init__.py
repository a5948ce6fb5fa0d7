"""Storage backends behind one async :class:`Store` protocol, and the :func:`open_store` factory.

``S3Store`` is imported lazily (aioboto3 is heavy and only needed for remote storage).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mithril_async.errors import ConfigError
from mithril_async.storage.base import (
    BlobWriter,
    DirListing,
    Store,
    check_key,
    check_prefix,
    join_key,
    key_in_prefix,
)
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore

if TYPE_CHECKING:
    from mithril_async.storage.s3 import S3Store

_MIB = 1 << 20
_S3_OPTIONS = (
    "endpoint_url",
    "region_name",
    "part_size",
    "max_concurrency",
    "max_attempts",
    "conditional_writes",
)


def _s3(bucket: str, prefix: str, options: Mapping[str, Any]) -> S3Store:
    from mithril_async.storage.s3 import S3Store

    unknown = set(options) - set(_S3_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown S3 store options: {sorted(unknown)}")
    return S3Store(bucket, prefix, **options)


def open_store(url_or_config: Any, **options: Any) -> Store:
    """Open a store from a URL, a path, or a remote config.

    - ``"file:///abs/path"``, ``"local:///abs/path"`` or a plain path -> :class:`LocalStore`
      (``options``: ``durable``)
    - ``"memory://"`` (optionally ``memory://name``) -> :class:`MemoryStore`
    - ``"s3://bucket/prefix"`` -> ``S3Store`` (``options``: endpoint_url, region_name,
      part_size, max_concurrency, max_attempts, conditional_writes)
    - a mapping or object with a ``bucket`` field (e.g. ``config.RemoteConfig``: bucket, prefix,
      endpoint_url, region_name, part_mib, max_concurrency, max_attempts) -> ``S3Store``
    """
    if isinstance(url_or_config, str):
        url = url_or_config
        if url.startswith("s3://"):
            bucket, _, prefix = url[len("s3://") :].partition("/")
            if not bucket:
                raise ConfigError(f"S3 URL without a bucket: {url!r}")
            return _s3(bucket, prefix, options)
        if url.startswith("memory://"):
            return MemoryStore(url[len("memory://") :])
        for scheme in ("file://", "local://"):
            if url.startswith(scheme):
                path = url[len(scheme) :]
                if not path.startswith("/"):
                    raise ConfigError(f"{scheme} URL needs an absolute path: {url!r}")
                return LocalStore(path, **options)
        if "://" in url:
            raise ConfigError(f"unsupported store URL scheme: {url!r}")
        return LocalStore(url, **options)
    if hasattr(url_or_config, "__fspath__"):
        return LocalStore(url_or_config, **options)
    cfg: Mapping[str, Any]
    if isinstance(url_or_config, Mapping):
        cfg = url_or_config
    elif hasattr(url_or_config, "model_dump"):
        cfg = url_or_config.model_dump()
    elif hasattr(url_or_config, "bucket"):
        cfg = vars(url_or_config)
    else:
        raise ConfigError(f"cannot open a store from {type(url_or_config).__name__}")
    if "bucket" not in cfg:
        raise ConfigError("remote store config needs a 'bucket'")
    opts: dict[str, Any] = {k: cfg[k] for k in _S3_OPTIONS if cfg.get(k) is not None}
    if cfg.get("part_mib") is not None:
        opts["part_size"] = int(cfg["part_mib"]) * _MIB
    opts.update(options)
    return _s3(str(cfg["bucket"]), str(cfg.get("prefix") or ""), opts)


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from mithril_async.storage.s3 import S3Store

        return S3Store
    raise AttributeError(name)


__all__ = [
    "BlobWriter",
    "DirListing",
    "LocalStore",
    "MemoryStore",
    "S3Store",
    "Store",
    "check_key",
    "check_prefix",
    "join_key",
    "key_in_prefix",
    "open_store",
]
