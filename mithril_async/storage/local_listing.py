"""Walking the folders of a :class:`~mithril_async.storage.local.LocalStore`: the keys under a
prefix (with their sizes), one folder level, and the temp files unfinished writers left.

Pure walks on a worker thread: the store checks the prefix (no symlink out of the root) and
passes the folder to walk. Only regular files are keys, never followed through a symlink;
temp and lock files and names no key can have are skipped. Every system call goes through the
store's file system module (``fs``, the store's ``os``), the one name the fault and power-loss
tests replace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

from mithril_async.errors import UnsafeKey
from mithril_async.storage.base import (
    RESERVED_PREFIX,
    DirListing,
    check_key,
    child_name,
    key_in_prefix,
)
from mithril_async.storage.local_lock import LOCK_NAME


def walk(fs: ModuleType, top: str, rel: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Yield (key, entry) of regular files and reserved temp files below ``top``."""
    try:
        it = fs.scandir(top)
    except (FileNotFoundError, NotADirectoryError):
        return
    with it:
        for entry in it:
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                yield from walk(fs, entry.path, key)
            elif entry.is_file(follow_symlinks=False):
                yield key, entry


def keys(fs: ModuleType, top: str, rel: str) -> Iterator[str]:
    """Yield the keys of the regular files below ``top`` (whose key is ``rel``), skipping
    temp/lock files and names no key can have."""
    for key, _entry in walk(fs, top, rel):
        try:
            yield check_key(key)
        except UnsafeKey:
            continue


def sized_keys(fs: ModuleType, top: str, norm: str, sized: bool) -> dict[str, int]:
    """The keys under the normalised prefix ``norm`` (whose folder is ``top``), sorted, from
    one walk, each with its size where ``sized`` (else 0: nothing is stat'ed)."""
    out: dict[str, int] = {}
    if norm and fs.path.isfile(top) and not fs.path.islink(top):
        out[norm] = fs.stat(top, follow_symlinks=False).st_size if sized else 0
    for key, entry in walk(fs, top, norm):
        try:
            out[check_key(key)] = entry.stat(follow_symlinks=False).st_size if sized else 0
        except (UnsafeKey, FileNotFoundError):
            continue
    return {k: out[k] for k in sorted(out) if key_in_prefix(k, norm)}


def dir_level(fs: ModuleType, top: str, norm: str) -> DirListing:
    """The files and folders directly under the prefix ``norm`` (whose folder is ``top``)."""
    files: list[str] = []
    dirs: list[str] = []
    try:
        it = fs.scandir(top)
    except (FileNotFoundError, NotADirectoryError):
        return DirListing(files, dirs)
    with it:
        for entry in it:
            if child_name(entry.name) is None:  # temp/lock files, foreign names
                continue
            if entry.is_dir(follow_symlinks=False):
                # a folder counts only with a key below it, as on S3 (not an empty
                # directory, nor one holding only a running writer's temp file)
                rel = f"{norm}/{entry.name}" if norm else entry.name
                if next(keys(fs, entry.path, rel), None) is not None:
                    dirs.append(entry.name)
            elif entry.is_file(follow_symlinks=False):
                files.append(entry.name)
    return DirListing(sorted(files), sorted(dirs))


def leftovers(fs: ModuleType, top: str, norm: str) -> list[tuple[str, os.DirEntry[str]]]:
    """(path below the root, entry) of every temp file of a writer under ``norm`` (whose
    folder is ``top``), and of the key ``norm`` itself, which live beside it."""
    candidates = list(walk(fs, top, norm))
    if norm:  # temps of the key ``norm`` itself live in its parent directory
        parent = fs.path.dirname(top)
        own = f"{RESERVED_PREFIX}{fs.path.basename(top)[:100]}."
        rel_parent = fs.path.dirname(norm)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            candidates += [(f"{rel_parent}/{e.name}" if rel_parent else e.name, e)
                           for e in fs.scandir(parent) if e.name.startswith(own)]
    return [(rel, e) for rel, e in candidates
            if e.name.startswith(RESERVED_PREFIX) and e.name != LOCK_NAME]
