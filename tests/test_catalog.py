"""RunCatalog through its public methods, on a MemoryStore and on a LocalStore in tmp_path:
claiming version numbers, listing committed versions, aliases, resolving restore targets,
deleting versions, cleaning unfinished ones and repairing aliases. The last tests read runs
that a real CheckpointManager wrote.

Versions are committed here the way a save does it: claim a number, write the blobs, then
the manifest with put_if_absent (a version exists iff its manifest does).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Awaitable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from mithril_async import CheckpointManager, parse_config
from mithril_async.catalog import RunCatalog, open_catalog
from mithril_async.claims import owner_identity
from mithril_async.errors import InvalidFormat, UnsafeKey, VersionNotFound
from mithril_async.layout import RunLayout
from mithril_async.manifest import (
    MAX_METADATA_BYTES,
    BlobRef,
    RankKey,
    ResumeInfo,
    RngEntry,
    VersionManifest,
    dump_model,
    version_id,
)
from mithril_async.storage.base import Store
from mithril_async.storage.local import LocalStore
from mithril_async.storage.memory import MemoryStore

T = TypeVar("T")
LAY = RunLayout("runs", "run1")
WHEN = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
HASH = "0123456789abcdef"


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else LocalStore(tmp_path / "store",
                                                                          durable=False)
    yield s
    run(s.close())


def key(n: int) -> str:
    return LAY.manifest_key(n)


def make_manifest(n: int, step: int, metrics: dict[str, Any] | None = None,
                  **kw: Any) -> VersionManifest:
    fields: dict[str, Any] = {
        "run_id": LAY.run_id, "version_id": version_id(n), "created_at": WHEN, "step": step,
        "model": BlobRef(key=LAY.model_key(n, "mckp"), bytes=5, xxh64=HASH),
        "rng": RngEntry(keys=[RankKey(key=LAY.rng_key(n, 0), rank=0)]),
        "resume": ResumeInfo(base_step=step, exact=True), "metrics": metrics or {}}
    fields.update(kw)
    return VersionManifest(**fields)


async def commit(cat: RunCatalog, step: int, metrics: dict[str, Any] | None = None
                 ) -> VersionManifest:
    """One save: claim, blobs, manifest last."""
    n = await cat.claim_version()
    await cat.store.put(LAY.model_key(n, "mckp"), b"model")
    await cat.store.put(LAY.rng_key(n, 0), b"{}")
    m = make_manifest(n, step, metrics)
    await cat.store.put_if_absent(key(n), dump_model(m))
    return m


async def steps(cat: RunCatalog, **kw: Any) -> list[int]:
    return [m.step for m in await cat.versions(**kw)]


# ------------------------------------------------------------------------------ claims
def test_claims_number_versions_in_order(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        assert await cat.versions() == [] and await cat.version_numbers() == {}
        assert [await cat.claim_version() for _ in range(3)] == [1, 2, 3]
        assert await cat.version_numbers() == {1: False, 2: False, 3: False}
        assert await cat.versions() == []  # claimed is not committed
        claim = json.loads(await store.get(LAY.claim_key(2)))
        assert claim["host"] == socket.gethostname() and claim["pid"] == os.getpid()
        assert await RunCatalog(store, LAY).claim_version() == 4  # another writer goes on
        # concurrent claims from two catalogs never share a number
        other = RunCatalog(store, LAY)
        got = await asyncio.gather(cat.claim_version(), other.claim_version(),
                                   cat.claim_version(), other.claim_version())
        assert sorted(got) == [5, 6, 7, 8]

    run(body())


def test_claims_follow_the_highest_folder_and_ignore_foreign_names(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await store.put(LAY.version_dir(10) + "/model.mckp", b"left by a killed writer")
        await store.put(LAY.versions_prefix + "notes/readme.txt", b"not a version")
        await store.put(LAY.versions_prefix + "v12/x", b"too few digits")
        await store.put(LAY.alias_key("latest"), b"{}")  # outside versions/
        assert await cat.version_numbers() == {10: False}
        assert await cat.claim_version() == 11
        other = RunCatalog(store, RunLayout("runs", "run2"))  # runs do not share numbers
        assert await other.claim_version() == 1

    run(body())


# ------------------------------------------------------------------------------ versions
def test_versions_are_the_committed_ones_oldest_step_first(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        for step in (30, 10, 20):  # v1, v2, v3
            await commit(cat, step)
        await cat.claim_version()  # v4: claimed, never committed
        await store.put(LAY.model_key(4, "mckp"), b"partial")
        for c in (cat, RunCatalog(store, LAY)):  # cached or fresh: the same answer
            vs = await c.versions()
            assert [m.step for m in vs] == [10, 20, 30]
            assert [m.version_id for m in vs] == ["v000002", "v000003", "v000001"]
        assert await cat.version_numbers() == {1: True, 2: True, 3: True, 4: False}
        await commit(cat, 20)  # v5: the same step again sorts after by version id
        assert [(m.step, m.version_id) for m in await cat.versions()] == [
            (10, "v000002"), (20, "v000003"), (20, "v000005"), (30, "v000001")]

    run(body())


def test_damaged_manifests_fail_the_listing_unless_skipped(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await commit(cat, 1)  # v1: fine
        bad: dict[int, bytes] = {
            2: b"{not json",
            3: dump_model(make_manifest(3, 3, run_id="other")),  # another run's manifest
            4: dump_model(make_manifest(9, 4)),  # claims to be v000009
            5: dump_model(make_manifest(5, 5, model=BlobRef(
                key="runs/other/versions/v000001/model.mckp", bytes=1, xxh64=HASH))),
        }
        for n, data in bad.items():
            assert await cat.claim_version() == n
            await store.put_if_absent(key(n), data)
        await commit(cat, 6)  # v6: fine
        with pytest.raises(InvalidFormat, match=r"v000002/manifest\.json"):
            await cat.versions()
        assert await steps(cat, skip_damaged=True) == [1, 6]
        assert await steps(RunCatalog(store, LAY), skip_damaged=True) == [1, 6]
        for n, why in ((2, "not valid JSON"), (3, "names run 'other'"),
                       (4, "claims version v000009"), (5, "outside its run")):
            with pytest.raises(InvalidFormat, match=why):
                await RunCatalog(store, LAY).read_manifest(key(n))
        assert (await cat.read_manifest(key(6))).step == 6
        with pytest.raises(InvalidFormat, match="outside run"):
            await cat.read_manifest("runs/run2/versions/v000001/manifest.json")

    run(body())


def test_committed_steps_come_from_run_json_and_the_manifests_it_does_not_name(
        store: Store) -> None:
    """What a manager's start needs (the saved steps) without parsing every kept manifest:
    run.json for the versions it names that are committed now, the manifests of the others."""
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        for step in (10, 20, 30):
            await commit(cat, step)
        await cat.update_run_manifest(None, None)  # names v1-v3
        await commit(cat, 40)  # v4: committed after run.json was written
        await cat.delete_version(version_id(1))  # still named by run.json
        fresh = RunCatalog(store, LAY)
        parsed: list[str] = []
        real = fresh.read_manifest

        async def counting(k: str) -> VersionManifest:
            parsed.append(k)
            return await real(k)

        fresh.read_manifest = counting  # type: ignore[method-assign]
        assert await fresh.committed_steps() == {20, 30, 40} == set(await steps(cat))
        assert parsed == [key(4)]  # only the version run.json does not name
        # a damaged run.json: every manifest is read; a damaged manifest is left out
        await store.put(LAY.run_manifest_key, b"{not json")
        await store.delete(key(3))
        await store.put_if_absent(key(3), b"{not json")
        assert await RunCatalog(store, LAY).committed_steps() == {20, 40}

    run(body())


def test_a_huge_sparse_manifest_is_refused_without_reading_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, durable=False)

    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await commit(cat, 1)
        n = await cat.claim_version()
        path = tmp_path / key(n)
        with open(path, "wb") as f:  # 1 TiB that occupies no disk
            f.truncate(1 << 40)
        with pytest.raises(InvalidFormat, match="implausibly large"):
            await cat.read_manifest(key(n))
        assert await steps(cat, skip_damaged=True) == [1]

    assert MAX_METADATA_BYTES < 1 << 40
    run(body())


# ------------------------------------------------------------------------------ aliases
def test_latest_only_moves_forward(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        assert await cat.read_alias("latest") is None
        m1 = await commit(cat, 10)
        assert await cat.move_latest(m1, key(1)) is True
        alias = await cat.read_alias("latest")
        assert alias is not None and alias.status == "ok" and alias.run_id == "run1"
        assert (alias.version_id, alias.step, alias.manifest_key) == ("v000001", 10, key(1))
        m2 = await commit(cat, 5)
        assert await cat.move_latest(m2, key(2)) is False  # an older step never wins
        assert (await RunCatalog(store, LAY).read_alias("latest")).step == 10  # type: ignore
        m3 = await commit(cat, 20)
        assert await cat.move_latest(m3, key(3)) is True
        m4 = await commit(cat, 20)  # the same step, a later version: it wins the tie
        assert await cat.move_latest(m4, key(4)) is True
        assert await cat.move_latest(m3, key(3)) is False
        alias = await cat.read_alias("latest")
        assert alias is not None and alias.version_id == "v000004"

    run(body())


def test_best_starts_pending_and_moves_only_to_a_better_metric(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await cat.ensure_best_pending("loss", "min")
        best = await cat.read_alias("best")
        assert best is not None and best.status == "pending" and best.manifest_key is None
        assert (best.metric_name, best.mode) == ("loss", "min")
        with pytest.raises(VersionNotFound, match="no version yet"):
            await cat.resolve("best")
        unusable: list[dict[str, Any]] = [{}, {"loss": math.nan}, {"loss": True},
                                          {"loss": "low"}, {"acc": 0.1}]
        for i, metrics in enumerate(unusable):
            m = await commit(cat, i, metrics)
            assert await cat.move_best(m, key(i + 1), "loss", "min") is False, metrics
        m = await commit(cat, 10, {"loss": 0.5})
        assert await cat.move_best(m, key(6), None, "min") is False  # no metric configured
        assert (await cat.read_alias("best")).status == "pending"  # type: ignore[union-attr]
        assert await cat.move_best(m, key(6), "loss", "min") is True
        for step, loss, moved in ((11, 0.7, False), (12, 0.2, True), (13, 0.2, False),
                                  (14, 1, False)):
            m = await commit(cat, step, {"loss": loss})
            assert await cat.move_best(m, key(len(unusable) + step - 9), "loss", "min") is moved
        best = await cat.read_alias("best")
        assert best is not None and best.status == "ok" and best.step == 12
        assert best.metric_value == 0.2 and best.version_id == "v000008"
        await cat.ensure_best_pending("loss", "min")  # never resets a best that exists
        assert (await cat.read_alias("best")).step == 12  # type: ignore[union-attr]
        assert await cat.resolve("best") == key(8)

    run(body())


def test_best_in_max_mode(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        moved = []
        for i, acc in enumerate((0.5, 0.4, 0.9, 0.9, 3)):
            m = await commit(cat, i, {"acc": acc})
            moved.append(await cat.move_best(m, key(i + 1), "acc", "max"))
        assert moved == [True, False, True, False, True]  # an int metric is a number too
        best = await cat.read_alias("best")
        assert best is not None and best.metric_value == 3.0 and best.mode == "max"

    run(body())


# ------------------------------------------------------------------------------ resolve
def test_resolve_every_kind_of_target(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        with pytest.raises(VersionNotFound, match="no version yet"):
            await cat.resolve("latest")
        m1 = await commit(cat, 10, {"loss": 0.1})
        m2 = await commit(cat, 20, {"loss": 0.3})
        await cat.claim_version()  # v3: never committed
        await cat.move_latest(m1, key(1))
        await cat.move_latest(m2, key(2))
        await cat.move_best(m1, key(1), "loss", "min")
        await cat.move_best(m2, key(2), "loss", "min")
        assert await cat.resolve("latest") == key(2)
        assert await cat.resolve("best") == key(1)
        assert await cat.resolve("v000002") == key(2)
        assert await cat.resolve(10) == key(1)
        assert await cat.resolve(20) == key(2)
        assert await cat.resolve(key(1)) == key(1)
        await commit(cat, 10)  # v4, the same step as v1: the newest version of it wins
        assert await cat.resolve(10) == key(4)

    run(body())


@pytest.mark.parametrize("target,match", [
    (30, "no committed version at step 30"),
    (-1, "no committed version at step -1"),
    (True, "not a restore target"),
    ("v000003", "no committed version 'v000003'"),  # claimed, never committed
    ("v000099", "no committed version"),
    ("runs/run2/versions/v000001/manifest.json", "no committed version"),  # another run
    ("runs/run1/versions/v000099/manifest.json", "no committed version"),
    ("newest", "not a restore target"),
    ("", "not a restore target"),
    ("v", "not a restore target"),
    ("10", "not a restore target"),  # a step is an int, not a string
])
def test_resolve_errors(store: Store, target: Any, match: str) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await commit(cat, 10)
        await commit(cat, 20)
        await cat.claim_version()
        with pytest.raises(VersionNotFound, match=match) as info:
            await cat.resolve(target)
        assert isinstance(info.value, FileNotFoundError)

    run(body())


def test_resolve_refuses_unsafe_keys_and_dangling_aliases(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        m = await commit(cat, 10)
        await cat.move_latest(m, key(1))
        with pytest.raises(UnsafeKey):
            await cat.resolve("runs/run1/../run2/versions/v000001/manifest.json")
        await store.delete(key(1))  # the manifest vanished behind the alias
        with pytest.raises(VersionNotFound, match="missing manifest"):
            await cat.resolve("latest")

    run(body())


# ------------------------------------------------------------------------------ delete
def test_delete_version_removes_it_and_only_it(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        for step in (1, 2, 3):
            await commit(cat, step)
        assert (await cat.read_manifest(key(2))).step == 2  # cached before the delete
        await cat.delete_version("v000002")
        assert await store.list(LAY.version_dir(2) + "/") == []
        assert await steps(cat) == [1, 3]
        assert await steps(RunCatalog(store, LAY)) == [1, 3]
        assert 2 not in await cat.version_numbers()
        with pytest.raises(VersionNotFound):
            await cat.resolve("v000002")
        with pytest.raises(VersionNotFound):
            await cat.resolve(2)
        for n in (1, 3):  # the others keep every file
            assert sorted(await store.list(LAY.version_dir(n) + "/")) == sorted(
                [LAY.claim_key(n), key(n), LAY.model_key(n, "mckp"), LAY.rng_key(n, 0)])
        assert await cat.claim_version() == 4
        with pytest.raises(InvalidFormat, match="not a version id"):
            await cat.delete_version("2")

    run(body())


# ------------------------------------------------------------------------------ cleaning
def _dead_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return (1 << 22) + 1


def test_clean_unfinished_removes_abandoned_versions_only(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await commit(cat, 1)  # v1: committed
        claims: dict[int, bytes | None] = {
            # this boot and PID namespace, no such pid: provably dead (a pid alone, without
            # boot and namespace, proves nothing: see tests/faults/test_shared_run.py)
            3: json.dumps({**owner_identity(), "pid": _dead_pid(), "t": time.time()}).encode(),
            4: json.dumps({"host": "elsewhere.invalid", "pid": 1, "t": time.time()}).encode(),
            5: json.dumps({"host": "elsewhere.invalid", "pid": 1, "t": 0}).encode(),
            6: None,  # blobs without a claim (a deletion killed half-way)
            7: b"not json",
            8: b"[1, 2]",
        }
        assert await cat.claim_version() == 2  # v2: a fresh claim of this live process
        for n, claim in claims.items():
            if claim is not None:
                await store.put_if_absent(LAY.claim_key(n), claim)
            await store.put(LAY.model_key(n, "mckp"), b"partial")
        await store.put(LAY.model_key(2, "mckp"), b"being written")
        removed = await cat.clean_unfinished()
        assert sorted(removed) == [LAY.version_dir(n) for n in (3, 5, 6, 7, 8)]
        assert await cat.version_numbers() == {1: True, 2: False, 4: False}
        assert await store.get(LAY.model_key(2, "mckp")) == b"being written"
        assert await store.exists(LAY.model_key(4, "mckp"))  # another host, recent claim
        assert await steps(cat) == [1]
        assert await cat.clean_unfinished() == []  # nothing more to do
        # a shorter staleness bound makes the other host's claim abandoned too
        assert await cat.clean_unfinished(stale_after_s=-1) == [LAY.version_dir(4)]
        assert await cat.version_numbers() == {1: True, 2: False}

    run(body())


# ------------------------------------------------------------------------------ repair
def test_repair_aliases_finishes_a_killed_writers_moves(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        assert await cat.repair_aliases("loss", "min") is False  # no versions: nothing to do
        m1 = await commit(cat, 1, {"loss": 0.3})
        await cat.move_latest(m1, key(1))
        await cat.ensure_best_pending("loss", "min")
        await commit(cat, 2, {"loss": 0.1})
        await commit(cat, 3, {"loss": 0.2})  # killed before moving any alias
        await cat.claim_version()  # v4 unfinished, v5 damaged: both ignored
        await store.put_if_absent(key(5), b"garbage")
        assert await cat.repair_aliases("loss", "min") is True
        latest, best = await cat.read_alias("latest"), await cat.read_alias("best")
        assert latest is not None and latest.step == 3 and latest.manifest_key == key(3)
        assert best is not None and best.step == 2 and best.metric_value == 0.1
        assert await cat.repair_aliases("loss", "min") is False  # already right
        assert await RunCatalog(store, LAY).repair_aliases("loss", "min") is False

    run(body())


def test_repair_never_moves_latest_back_and_needs_a_metric_for_best(store: Store) -> None:
    async def body() -> None:
        cat = RunCatalog(store, LAY)
        await commit(cat, 1, {"loss": 0.5})
        m2 = await commit(cat, 2, {"loss": 0.9})
        await cat.move_latest(m2, key(2))
        await store.delete(key(2))  # the newest committed is now step 1
        assert await cat.repair_aliases(None, "min") is False
        latest = await cat.read_alias("latest")
        assert latest is not None and latest.step == 2  # never moved backwards
        assert await cat.read_alias("best") is None  # no metric: best untouched

    run(body())


# ------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run saved by CheckpointManager: steps 10, 20, 30 with losses 0.5, 0.2, 0.9."""
    runs = tmp_path_factory.mktemp("real") / "runs"
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "run1"\n'
                       'best_metric_name = "loss"\n')
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with CheckpointManager(cfg, {"model": model}) as m:
        for step, loss in ((10, 0.5), (20, 0.2), (30, 0.9)):
            with torch.no_grad():
                model.weight.add_(1.0)
            m.save_nowait(step, metrics={"loss": loss}).result()
    return runs


@pytest.fixture
def runs(real_runs: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "runs"
    shutil.copytree(real_runs, copy)
    return copy


def test_catalog_reads_a_real_run(runs: Path) -> None:
    async def body() -> None:
        cat = open_catalog(runs, "run1")
        assert cat.layout == LAY
        vs = await cat.versions()
        assert [(m.version_id, m.step, m.metrics["loss"]) for m in vs] == [
            ("v000001", 10, 0.5), ("v000002", 20, 0.2), ("v000003", 30, 0.9)]
        assert await cat.version_numbers() == {1: True, 2: True, 3: True}
        assert await cat.resolve("latest") == key(3)
        assert await cat.resolve("best") == key(2)
        assert await cat.resolve(20) == await cat.resolve("v000002") == key(2)
        best = await cat.read_alias("best")
        assert best is not None and best.metric_value == 0.2 and best.metric_name == "loss"
        assert await cat.repair_aliases("loss", "min") is False  # the manager moved them
        assert await cat.clean_unfinished() == []
        await cat.store.close()

    run(body())


def test_a_version_deleted_through_the_catalog_is_gone_for_a_manager(runs: Path) -> None:
    async def body() -> None:
        cat = open_catalog(runs, "run1")
        await cat.delete_version("v000001")
        assert await steps(cat) == [20, 30]
        await cat.store.close()

    run(body())
    assert not (runs / "run1" / "versions" / "v000001" / "manifest.json").exists()
    cfg = parse_config(f'[checkpointing]\nruns_path = "{runs}"\nrun_id = "run1"\n')
    model = torch.nn.Linear(8, 4)
    with CheckpointManager(cfg, {"model": model}) as m:
        assert m.all_steps() == [20, 30]
        assert m.restore_sync("latest") == 30
        with pytest.raises(VersionNotFound):
            m.restore_sync(10)
        m.save_nowait(40).result()  # numbering goes on after the highest folder
        assert m.all_steps() == [20, 30, 40]
    assert (runs / "run1" / "versions" / "v000004" / "manifest.json").exists()
