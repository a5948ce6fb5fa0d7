"""Native byte-transform kernels against the numpy oracle, on every SIMD level this CPU has.

Why these tests: the kernels rearrange every checkpoint byte; a wrong tail, an unaligned load or
one SIMD level diverging from the others would corrupt checkpoints silently.  Property tests
compare each forced level with :mod:`mithril_async.codec.kernels_ref` on random lengths (0, odd
tails, several SIMD blocks) at unaligned offsets inside larger buffers.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mithril_async.codec import kernels as K
from mithril_async.codec import kernels_ref as R

NATIVE_LEVELS = [b for b in K.available_backends() if b != "numpy"]
ALL_LEVELS = ["numpy", *NATIVE_LEVELS]
KINDS = ["bf16", "fp16", "fp32"]


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Force a backend for the duration of a block, restoring the best one afterwards."""
    K.set_backend(name)
    try:
        yield
    finally:
        K.set_backend(None)


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _buffers(data: st.DataObject, n: int, count: int) -> list[np.ndarray]:
    """``count`` random byte arrays of length ``n``, each at an unaligned offset in a bigger one."""
    out = []
    for _ in range(count):
        off = data.draw(st.integers(0, 31))
        big = np.frombuffer(
            data.draw(st.binary(min_size=n + off + 7, max_size=n + off + 7)), np.uint8
        )
        out.append(
            big[off : off + n].copy() if data.draw(st.booleans()) else big.copy()[off : off + n]
        )
    return out


LENGTHS = st.one_of(
    st.integers(0, 40), st.integers(0, 700), st.sampled_from([255, 256, 257, 511, 512, 513])
)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=LENGTHS, width=st.sampled_from(R.WIDTHS))
def test_grouping_matches_oracle_on_every_level(data: st.DataObject, n: int, width: int) -> None:
    a, b = _buffers(data, n, 2)
    want = {
        "group": R.group(a, width),
        "ungroup": R.ungroup(a, width),
        "xor": R.xor(a, b),
        "xor_group": R.xor_group(a, b, width),
        "ungroup_xor": R.ungroup_xor(a, b, width),
    }
    for level in ALL_LEVELS:
        with backend(level):
            got = {
                "group": K.group(a, width),
                "ungroup": K.ungroup(a, width),
                "xor": K.xor(a, b),
                "xor_group": K.xor_group(a, b, width),
                "ungroup_xor": K.ungroup_xor(a, b, width),
            }
            off = data.draw(st.integers(1, 31))
            got["group"] = K.group(a, width, out=np.empty(n + off, np.uint8)[off:])  # unaligned out
        for name, arr in got.items():
            assert arr.dtype == np.uint8 and arr.shape == (n,)
            np.testing.assert_array_equal(arr, want[name], err_msg=f"{name} on {level}, n={n}")


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=LENGTHS, kind=st.sampled_from(KINDS), with_base=st.booleans())
def test_exponent_planes_match_oracle_on_every_level(
    data: st.DataObject, n: int, kind: str, with_base: bool
) -> None:
    a, b = _buffers(data, n, 2)
    base = b if with_base else None
    want_g = R.exp_group(a, kind, base)
    want_u = R.exp_ungroup(a, kind, base)
    for level in ALL_LEVELS:
        with backend(level):
            g = K.exp_group(a, kind, base)
            u = K.exp_ungroup(a, kind, base)
            back = K.exp_ungroup(g, kind, base)
        np.testing.assert_array_equal(g, want_g, err_msg=f"exp_group {kind} on {level}")
        np.testing.assert_array_equal(u, want_u, err_msg=f"exp_ungroup {kind} on {level}")
        np.testing.assert_array_equal(back, a, err_msg=f"exp roundtrip {kind} on {level}")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=LENGTHS, width=st.sampled_from(R.WIDTHS))
def test_roundtrips(data: st.DataObject, n: int, width: int) -> None:
    a, b = _buffers(data, n, 2)
    np.testing.assert_array_equal(K.ungroup(K.group(a, width), width), a)
    np.testing.assert_array_equal(K.group(K.ungroup(a, width), width), a)
    np.testing.assert_array_equal(K.ungroup_xor(K.xor_group(a, b, width), b, width), a)
    np.testing.assert_array_equal(K.xor(K.xor(a, b), b), a)
    np.testing.assert_array_equal(K.xor_group(a, b, width), K.group(K.xor(a, b), width))
    np.testing.assert_array_equal(R.ungroup(R.group(a, width), width), a)


@pytest.mark.parametrize("level", NATIVE_LEVELS)
def test_large_buffer_all_kernels(level: str) -> None:
    """Long SIMD loops, the tiled width-8 path (plane stride near a multiple of 4 KiB) and a
    length that leaves a tail everywhere."""
    rng = np.random.default_rng(7)
    n = (1 << 20) + 13
    a = rng.integers(0, 256, n, dtype=np.uint8)
    b = rng.integers(0, 256, n, dtype=np.uint8)
    with backend(level):
        for w in R.WIDTHS:
            np.testing.assert_array_equal(K.group(a, w), R.group(a, w))
            np.testing.assert_array_equal(K.xor_group(a, b, w), R.xor_group(a, b, w))
            np.testing.assert_array_equal(K.ungroup_xor(a, b, w), R.ungroup_xor(a, b, w))
        for kind in ("bf16", "fp32"):
            np.testing.assert_array_equal(K.exp_group(a, kind, b), R.exp_group(a, kind, b))
            np.testing.assert_array_equal(K.exp_ungroup(a, kind, b), R.exp_ungroup(a, kind, b))


@pytest.mark.parametrize("width", [1, 3, 5, 6, 16])
def test_other_widths_use_portable_path(width: int) -> None:
    rng = np.random.default_rng(width)
    for n in (0, width - 1, 5 * width + 3, 4099):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        b = rng.integers(0, 256, n, dtype=np.uint8)
        np.testing.assert_array_equal(K.group(a, width), R.group(a, width))
        np.testing.assert_array_equal(K.ungroup(a, width), R.ungroup(a, width))
        np.testing.assert_array_equal(K.xor_group(a, b, width), R.xor_group(a, b, width))
        np.testing.assert_array_equal(K.ungroup_xor(a, b, width), R.ungroup_xor(a, b, width))


def test_group_layout_by_hand() -> None:
    src = np.arange(11, dtype=np.uint8)  # 2 elements of 4 bytes + 3 tail bytes
    assert K.group(src, 4).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10]
    assert K.plane_sizes(4, 11) == (2, 2, 2, 2, 3)
    assert K.plane_sizes("bf16", 7) == (3, 3, 1)
    assert K.plane_sizes(8, 0) == (0,) * 9


def test_exponent_planes_of_known_floats() -> None:
    f32 = np.array([1.0, -1.5, 2.0**-126, -0.0], dtype=np.float32)
    g = K.exp_group(f32, "fp32").reshape(4, 4)  # no tail: rows are planes
    assert g[0].tolist() == [127, 127, 1, 0]  # exponent plane
    assert g[1].tolist() == [0x00, 0xC0, 0x00, 0x80]  # sign | top 7 mantissa bits
    bf16 = (f32.view(np.uint32) >> 16).astype("<u2")  # truncation gives exact bf16 here
    h = K.exp_group(bf16, "bf16").reshape(2, 4)
    assert h[0].tolist() == [127, 127, 1, 0]
    assert h[1].tolist() == [0x00, 0xC0, 0x00, 0x80]
    np.testing.assert_array_equal(K.exp_ungroup(h.reshape(-1), "bf16").view("<u2"), bf16)


def test_out_is_filled_in_place_and_inputs_accept_buffers() -> None:
    a = np.arange(100, dtype=np.uint8)
    out = np.zeros(100, dtype=np.uint8)
    res = K.group(a, 2, out=out)
    assert np.shares_memory(res, out)
    np.testing.assert_array_equal(out, R.group(a, 2))
    # bytes / bytearray / multi-byte dtypes are viewed as bytes without copying
    np.testing.assert_array_equal(K.group(bytes(a), 2), R.group(a, 2))
    ba = bytearray(100)
    K.ungroup(out, 2, out=ba)
    assert bytes(ba) == bytes(a)
    f = np.linspace(-1, 1, 33, dtype=np.float32).reshape(3, 11)
    np.testing.assert_array_equal(
        K.exp_ungroup(K.exp_group(f, "fp32"), "fp32").view(np.float32), f.ravel()
    )


def test_xor_in_place_and_ungroup_xor_into_base() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 1001, dtype=np.uint8)
    b = rng.integers(0, 256, 1001, dtype=np.uint8)
    want = a ^ b
    K.xor(a, b, out=a)
    np.testing.assert_array_equal(a, want)
    g = K.xor_group(want, b, 4)
    expected = R.ungroup_xor(g, b, 4)
    K.ungroup_xor(g, b, 4, out=b)  # restore onto the base buffer itself
    np.testing.assert_array_equal(b, expected)


def test_errors() -> None:
    a = np.zeros(64, dtype=np.uint8)
    for bad in (0, -2, 17):
        with pytest.raises(ValueError, match="width"):
            K.group(a, bad)
    with pytest.raises(ValueError, match="kind"):
        K.exp_group(a, "fp64")
    with pytest.raises(ValueError, match="expected exactly 64"):
        K.group(a, 2, out=np.zeros(63, dtype=np.uint8))
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros(64, dtype=np.uint8)
        ro.flags.writeable = False
        K.ungroup(a, 2, out=ro)
    with pytest.raises(ValueError, match="writable"):
        K.group(a, 2, out=bytes(64))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.group(np.zeros(128, dtype=np.uint8)[::2], 2)
    with pytest.raises(ValueError, match="base has 63 bytes"):
        K.xor_group(a, np.zeros(63, dtype=np.uint8), 2)
    with pytest.raises(ValueError, match="b has 65 bytes"):
        K.xor(a, np.zeros(65, dtype=np.uint8))
    with pytest.raises(ValueError, match="overlap"):
        K.group(a, 2, out=a)
    with pytest.raises(ValueError, match="overlap"):
        big = np.zeros(100, dtype=np.uint8)
        K.exp_group(big[:64], "bf16", out=big[10:74])
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.set_backend("avx512")
    with pytest.raises(ValueError, match="nbytes"):
        K.plane_sizes(2, -1)


def test_native_backend_in_use_on_this_machine() -> None:
    assert K.native_available(), K.BACKEND
    assert K.BACKEND.startswith("native"), K.BACKEND
    if _cpu_has_avx2():
        assert K.BACKEND == "native-avx2"
        assert "avx2" in K.available_backends()


def test_gil_released_during_native_calls() -> None:
    """Another Python thread must make progress while C busy-waits inside a kernel call."""
    stop = threading.Event()
    ticks = [0]

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count, daemon=True)
    t.start()
    try:
        time.sleep(0.02)
        before = ticks[0]
        K.spin_ns(300_000_000)
        during = ticks[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, f"other thread advanced only {during} ticks: GIL held during C call"


def _fresh_kernels_module(monkeypatch: pytest.MonkeyPatch, block_native: bool) -> ModuleType:
    """Import a private copy of kernels.py (so module-level backend selection runs again)."""
    if block_native:
        monkeypatch.setitem(sys.modules, "mithril_async._kernels", None)  # import -> ImportError
    spec = importlib.util.spec_from_file_location("_kernels_copy", K.__file__)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fallback_to_numpy_warns_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(RuntimeWarning, match="slow numpy path"):
        mod = _fresh_kernels_module(monkeypatch, block_native=True)
    assert mod.BACKEND.startswith("numpy (native extension unavailable")
    a = np.arange(77, dtype=np.uint8)
    np.testing.assert_array_equal(mod.group(a, 4), R.group(a, 4))
    np.testing.assert_array_equal(mod.exp_ungroup(a, "fp32", a), R.exp_ungroup(a, "fp32", a))


@pytest.mark.parametrize("level", NATIVE_LEVELS)
def test_env_var_forces_level(monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    monkeypatch.setenv("MITHRIL_KERNELS", level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mod = _fresh_kernels_module(monkeypatch, block_native=False)
        forced: str = mod.BACKEND
        assert forced == f"native-{level}"
    finally:
        K.set_backend(None)  # the level lives in the shared C library
    restored: str = K.BACKEND
    assert restored == f"native-{NATIVE_LEVELS[-1]}"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.one_of(LENGTHS, st.integers(4000, 70_000)))
def test_streaming_copy_matches_oracle_on_every_level(data: st.DataObject, n: int) -> None:
    """Every alignment of the destination (the head up to the vector boundary is a plain copy,
    the body non-temporal stores, the tail a plain copy again)."""
    (src,) = _buffers(data, n, 1)
    off = data.draw(st.integers(0, 63))
    big = np.full(n + off + 64, 0xA5, np.uint8)
    for level in ALL_LEVELS:
        big[:] = 0xA5
        with backend(level):
            out = K.copy_stream(src, big[off:off + n])
        np.testing.assert_array_equal(out, R.copy(src))
        assert (big[:off] == 0xA5).all() and (big[off + n:] == 0xA5).all()  # no spill


def test_streaming_copy_of_a_large_buffer_and_bad_arguments() -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (8 << 20) + 77, dtype=np.uint8)
    out = np.zeros(src.size + 1, np.uint8)
    for level in ALL_LEVELS:
        with backend(level):
            K.copy_stream(src, out[1:])
        np.testing.assert_array_equal(out[1:], src)
    with pytest.raises(ValueError, match="expected exactly"):
        K.copy_stream(src, out)
    with pytest.raises(ValueError, match="overlap"):
        K.copy_stream(src, src)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=6),
       stream_min=st.sampled_from([1, 4096, 1 << 20]))
def test_copy_batch_matches_oracle_on_every_level(
        data: st.DataObject, sizes: list[int], stream_min: int) -> None:
    """Many (src, dst, n) jobs in one call, each destination at its own alignment, some above
    and some below the streaming threshold: every job's bytes land, nothing around them moves."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    offs = [data.draw(st.integers(0, 63)) for _ in sizes]
    for level in ALL_LEVELS:
        bigs = [np.full(n + off + 64, 0xA5, np.uint8) for n, off in zip(sizes, offs, strict=True)]
        jobs = [(s.ctypes.data, b.ctypes.data + off, s.size)
                for s, b, off in zip(srcs, bigs, offs, strict=True)]
        with backend(level):
            K.copy_batch(jobs, stream_min)
        for s, b, off in zip(srcs, bigs, offs, strict=True):
            np.testing.assert_array_equal(b[off:off + s.size], R.copy(s))
            assert (b[:off] == 0xA5).all() and (b[off + s.size:] == 0xA5).all()


def test_copy_batch_refuses_malformed_jobs() -> None:
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    K.copy_batch([])  # nothing to do
    with pytest.raises(ValueError, match="job 1"):
        K.copy_batch([(src.ctypes.data, dst.ctypes.data, 8), (src.ctypes.data, dst.ctypes.data,
                                                            -1)])
    with pytest.raises(ValueError, match="job 0"):
        K.copy_batch([(src.ctypes.data, dst.ctypes.data)])  # type: ignore[list-item]
    assert not dst.any()  # a refused batch copies nothing
