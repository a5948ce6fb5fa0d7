"""``mithril verify PATH``: check every checksum and every delta base; stop at the first damage.

PATH is a runs folder (every run), a run folder (every version), a version folder or
``manifest.json`` (one version), or an ``.mckp`` file. For each version: the manifest parses
and names only keys of its run; every blob exists, has the recorded size and xxh64; MCKP blobs
are decoded one tensor at a time, checking each block header, payload and decoded-chunk hash
and that the blob decodes to the raw size its manifest records; delta bases and referenced
tensors are followed (their versions must still hold the exact blob the manifest recorded);
the config and RNG files exist and match. Aliases and ``run.json`` must parse and point at
committed versions.

Exit codes: 0 all good; 3 damage found (the message names the file, the block and its byte
range where one is known); 1 the path could not be read as a checkpoint at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mithril_async.commands._common import (
    EXIT_CORRUPT,
    ProgressBar,
    Target,
    gather_versions,
    human,
    locate,
    print_json,
    progress_bar,
    run_async,
)
from mithril_async.restore.reader import VersionReader


class Damage(Exception):
    """The first damage found: ``where`` names the file (and block), ``detail`` says what."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.detail = detail


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="check every checksum and delta base (exit 3 on damage)",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="PATH", help="runs folder, run, version, or .mckp file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print only damage (and no progress bar)")
    p.set_defaults(func=run)


def locate_block(data: bytes) -> str | None:
    """For an MCKP blob whose whole-file hash failed: the first block that fails its own hash."""
    from mithril_async.codec.container_read import block_from_bytes, parse_blob

    try:
        info = parse_blob(data, verify=False)
    except Exception as err:  # the damage is in the header, index or trailer
        return f"structure: {err}"
    mv = memoryview(data)
    for ref in sorted(info.index.values(), key=lambda r: r.offset):
        try:
            block_from_bytes(mv[ref.offset:ref.offset + ref.length], ref, info)
        except Exception as err:
            return (f"{info.block_name(ref.tensor, ref.chunk)} at bytes "
                    f"{ref.offset}..{ref.offset + ref.length}: {err}")
    return None


def check_mckp_bytes(data: bytes, where: str, bar: ProgressBar | None = None) -> int:
    """Decode every block of a standalone blob; return its tensor count or raise Damage.
    ``bar`` counts the raw bytes of the blocks checked."""
    from mithril_async.codec.chunk import decode_chunk
    from mithril_async.codec.container_read import block_from_bytes, parse_blob
    from mithril_async.errors import ChecksumMismatch, InvalidFormat

    try:
        info = parse_blob(data, verify=True)
    except ChecksumMismatch as err:
        raise Damage(where, f"{err}; {locate_block(data) or 'no block fails its own hash'}"
                     ) from None
    except InvalidFormat as err:
        raise Damage(where, str(err)) from None
    import numpy as np

    if bar is not None:
        bar.update_to(0, info.original_size)
    mv = memoryview(data)
    for ref in sorted(info.index.values(), key=lambda r: r.offset):
        name = info.block_name(ref.tensor, ref.chunk)
        try:
            meta, payload = block_from_bytes(mv[ref.offset:ref.offset + ref.length], ref, info)
            if not meta.is_delta:  # a delta's raw hash needs the base; its own hashes passed
                out = np.empty(meta.raw_size, np.uint8)
                decode_chunk(payload, meta, None, out, where=name, verify_payload=False)
        except (ChecksumMismatch, InvalidFormat) as err:
            raise Damage(where, f"{name} at bytes {ref.offset}..{ref.offset + ref.length}: "
                         f"{err}") from None
        if bar is not None:
            bar.advance(meta.raw_size)
    return len(info.tensors)


class Verifier:
    """Walks versions of one run, raising :class:`Damage` at the first problem; ``bar``
    counts the raw bytes of the blobs as they are decoded."""

    def __init__(self, target: Target, run_id: str, bar: ProgressBar) -> None:
        self.target = target
        self.catalog = target.catalog(run_id)
        self.reader = VersionReader(self.catalog, progress=bar.callback)
        self.blobs = 0
        self.bytes = 0

    async def check_file(self, key: str, size: int | None, xxh64: str | None) -> bytes:
        import xxhash

        from mithril_async.errors import KeyNotFound

        try:
            data = await self.catalog.store.get(key)
        except KeyNotFound:
            raise Damage(key, "missing") from None
        if size is not None and len(data) != size:
            raise Damage(key, f"{len(data)} bytes, manifest says {size}")
        if xxh64 is not None:
            got = xxhash.xxh64_hexdigest(data)
            if got != xxh64:
                detail = f"xxh64 {got}, manifest says {xxh64}"
                if data[:4] == b"MCKP":
                    detail += f"; {locate_block(data) or 'no block fails its own hash'}"
                raise Damage(key, detail)
        return data

    async def check_version(self, m: Any) -> None:
        from mithril_async.errors import MithrilError

        for ref in m.blobs():
            await self.check_file(ref.key, ref.bytes, ref.xxh64)
            try:
                await self.reader.check_blob(ref)  # one tensor at a time
            except MithrilError as err:
                raise Damage(ref.key, str(err)) from None
            self.blobs += 1
            self.bytes += ref.bytes
        if m.config is not None:
            await self.check_file(m.config.key, m.config.bytes, m.config.xxh64)
        for rk in m.rng.keys:
            data = await self.check_file(rk.key, None, rk.xxh64)
            try:
                step = json.loads(data).get("step")
            except (ValueError, AttributeError):
                raise Damage(rk.key, "not a JSON object") from None
            if step != m.step:
                from mithril_async.manifest import version_number

                key = self.catalog.layout.manifest_key(version_number(m.version_id))
                raise Damage(key, f"says step {m.step} but {rk.key} was saved at step {step}")

    async def check_aliases(self, committed: set[str]) -> None:
        from mithril_async.errors import MithrilError

        lay = self.catalog.layout
        for name in ("latest", "best"):
            try:
                alias = await self.catalog.read_alias(name)
            except MithrilError as err:
                raise Damage(lay.alias_key(name), str(err)) from None
            if alias is not None and alias.status == "ok" and alias.manifest_key not in committed:
                raise Damage(lay.alias_key(name), f"points at {alias.manifest_key}, which is "
                             "not a committed version")
        if await self.catalog.store.exists(lay.run_manifest_key):
            from mithril_async.manifest import RunManifest, parse_model

            try:
                parse_model(RunManifest, await self.catalog.store.get(lay.run_manifest_key),
                            lay.run_manifest_key)
            except MithrilError as err:
                raise Damage(lay.run_manifest_key, str(err)) from None


async def verify_target(target: Target, bar: ProgressBar) -> dict[str, Any]:
    from mithril_async.errors import MithrilError
    from mithril_async.manifest import version_number

    summary: dict[str, Any] = {"runs": 0, "versions": 0, "blobs": 0, "bytes": 0}
    try:
        per_run = await gather_versions(target)
    except MithrilError as err:  # an unreadable manifest is damage, not a usage error
        raise Damage(str(target.path), str(err)) from None
    bar.update_to(0, sum(b.raw_bytes for ms in per_run.values() for m in ms for b in m.blobs()))
    for run_id, versions in per_run.items():
        v = Verifier(target, run_id, bar)
        try:
            for m in versions:
                await v.check_version(m)
            if target.kind != "version":
                lay = v.catalog.layout
                await v.check_aliases({lay.manifest_key(version_number(m.version_id))
                                       for m in versions})
        finally:
            v.reader.close()
        summary["runs"] += 1
        summary["versions"] += len(versions)
        summary["blobs"] += v.blobs
        summary["bytes"] += v.bytes
    return summary


def run(args: argparse.Namespace) -> int:
    target = locate(args.path)
    try:
        with progress_bar(args, "verify") as bar:
            if target.kind == "file":
                data = Path(target.path).read_bytes()
                if data[:4] != b"MCKP":
                    raise Damage(str(target.path), "not an MCKP blob (bad magic)")
                n = check_mckp_bytes(data, str(target.path), bar)
                summary: dict[str, Any] = {"files": 1, "tensors": n, "bytes": len(data)}
            else:
                summary = run_async(verify_target(target, bar))
    except Damage as d:
        if args.json:
            print_json({"ok": False, "where": d.where, "error": d.detail})
        print(f"DAMAGED {d.where}: {d.detail}", file=sys.stderr)
        return EXIT_CORRUPT
    if args.json:
        print_json({"ok": True, **summary})
    elif not args.quiet:
        what = ", ".join(f"{v} {k}" for k, v in summary.items() if k != "bytes")
        print(f"OK: {what}, {human(summary['bytes'])} verified")
    return 0
