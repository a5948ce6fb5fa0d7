"""Fixed-width dtypes <-> stable names, and zero-copy tensor <-> bytes views.

The codec works on raw little-endian bytes; this module is the only place that knows how a
torch tensor (or numpy array) maps onto those bytes.  Names are the torch attribute names
(``"bfloat16"``, ``"float8_e4m3fn"``, ...): they are written into blobs and manifests, so they
must never change.  Dtypes without a fixed width (quantized, sparse, nested) are refused with
:class:`~mithril_async.errors.UnsupportedDtype`.

NumPy has no bfloat16 or float8; JAX arrays carry them as the ``ml_dtypes`` extension types
(``ml_dtypes.bfloat16`` ...), whose byte layouts are the same as torch's dtypes of the same
name.  When ``ml_dtypes`` is installed those numpy dtypes map onto the same stable names
(an ml_dtypes bfloat16 array and a torch bfloat16 tensor are the same bytes under the same
name), so JAX arrays reach the codec without a detour through torch.  The float8 variants
only ml_dtypes has (``float8_e4m3``, ``float8_e3m4``, ``float8_e4m3b11fnuz``) get names of
their own; sub-byte types (int4, float4, float6: one value per byte in numpy, packed in
torch) are refused, their two layouts would share a name.

Why zero-copy: the async manager snapshots tensors into its own host buffers and then hands them
to the codec; an extra copy here would double the memory traffic of every save.

torch is imported only by what needs a torch tensor (:func:`tensor_from_bytes`,
:attr:`DtypeInfo.torch_dtype`): a process that encodes bytes it did not make (the checkpoint
worker, reading the trainer's staging memory as :class:`RawTensor`) never loads it. A torch
tensor can only reach this module from a process that imported torch, so checking for one
looks it up in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

if TYPE_CHECKING:
    import torch

try:
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with jax; torch users may lack it
    _ml_dtypes = None  # type: ignore[assignment]

from mithril_async.errors import ShapeMismatch, UnsupportedDtype

__all__ = [
    "DTYPES",
    "DtypeInfo",
    "RawTensor",
    "SizedByName",
    "as_torch",
    "dtype_info",
    "dtype_name",
    "tensor_bytes",
    "tensor_from_bytes",
]

Kind = Literal["float", "int", "uint", "bool", "complex"]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("mithril_async.codec requires a little-endian host")


@dataclass(frozen=True)
class DtypeInfo:
    """What the codec needs to know about one dtype.

    ``group_width`` is the byte-grouping width (the component width for complex numbers, so a
    complex64 groups like float32); ``exp_kind`` names the exponent-plane transform that fits
    the bit layout (``"bf16"``/``"fp32"``) or ``None``.
    """

    name: str
    itemsize: int
    kind: Kind
    group_width: int
    exp_kind: str | None
    numpy_dtype: np.dtype[Any] | None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """torch's dtype of this name (None where torch has none); imports torch."""
        return _torch_dtypes().get(self.name)


class SizedByName:
    """``numel()`` / ``element_size()`` / ``nbytes`` of a tensor described by its stable
    dtype name (``dtype``) and ``shape``, with no torch tensor at hand."""

    dtype: str
    shape: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()


@dataclass(frozen=True)
class RawTensor(SizedByName):
    """A tensor as bytes: a flat ``uint8`` array, its stable dtype name and its shape.

    What a process without torch holds of a tensor another process staged (a view of shared
    memory, never a copy); the codec takes it wherever it takes a tensor.
    """

    data: np.ndarray[Any, np.dtype[np.uint8]]
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        info = dtype_info(self.dtype)
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise ShapeMismatch(f"RawTensor of {self.dtype}: data must be a flat uint8 array")
        if self.data.size != math.prod(self.shape) * info.itemsize:
            raise ShapeMismatch(f"{self.data.size} bytes do not hold "
                                f"{self.dtype}{list(self.shape)}")


def _ml_dtype(name: str) -> np.dtype[Any] | None:
    """The numpy dtype ``ml_dtypes`` gives ``name`` (None without ml_dtypes or that type)."""
    scalar = getattr(_ml_dtypes, name, None) if _ml_dtypes is not None else None
    return np.dtype(scalar) if scalar is not None else None


def _mk(name: str, itemsize: int, kind: Kind, *, group: int | None = None,
        exp: str | None = None, np_name: str | None = None, ml: bool = False,
        ) -> DtypeInfo:
    """``ml``: the numpy dtype is ml_dtypes' type of the same name (when installed)."""
    ndt = np.dtype(np_name) if np_name is not None else _ml_dtype(name) if ml else None
    if ndt is not None and ndt.itemsize != itemsize:  # pragma: no cover - a changed ml_dtypes
        ndt = None
    return DtypeInfo(name, itemsize, kind, group if group is not None else itemsize, exp, ndt)


_ALL = [
    _mk("float64", 8, "float", np_name="float64"),
    _mk("float32", 4, "float", exp="fp32", np_name="float32"),
    _mk("float16", 2, "float", np_name="float16"),
    _mk("bfloat16", 2, "float", exp="bf16", ml=True),
    _mk("float8_e4m3fn", 1, "float", ml=True),
    _mk("float8_e5m2", 1, "float", ml=True),
    _mk("float8_e4m3fnuz", 1, "float", ml=True),
    _mk("float8_e5m2fnuz", 1, "float", ml=True),
    _mk("float8_e8m0fnu", 1, "float", ml=True),
    _mk("float8_e4m3", 1, "float", ml=True),
    _mk("float8_e3m4", 1, "float", ml=True),
    _mk("float8_e4m3b11fnuz", 1, "float", ml=True),
    _mk("float4_e2m1fn_x2", 1, "float"),
    _mk("int8", 1, "int", np_name="int8"),
    _mk("int16", 2, "int", np_name="int16"),
    _mk("int32", 4, "int", np_name="int32"),
    _mk("int64", 8, "int", np_name="int64"),
    _mk("uint8", 1, "uint", np_name="uint8"),
    _mk("uint16", 2, "uint", np_name="uint16"),
    _mk("uint32", 4, "uint", np_name="uint32"),
    _mk("uint64", 8, "uint", np_name="uint64"),
    _mk("bool", 1, "bool", np_name="bool"),
    _mk("complex32", 4, "complex", group=2),
    _mk("complex64", 8, "complex", group=4, np_name="complex64"),
    _mk("complex128", 16, "complex", group=8, np_name="complex128"),
]

#: Every supported dtype by its stable name.
DTYPES: dict[str, DtypeInfo] = {i.name: i for i in _ALL}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """torch's dtype of each stable name torch has (imports torch)."""
    torch = importlib.import_module("torch")
    return {name: dt for name in DTYPES
            if isinstance(dt := getattr(torch, name, None), torch.dtype)}


@functools.cache
def _by_torch() -> dict[torch.dtype, DtypeInfo]:
    return {dt: DTYPES[name] for name, dt in _torch_dtypes().items()}


def _torch_module() -> Any:
    """torch, where this process imported it (else None: no torch tensor can exist)."""
    return sys.modules.get("torch")
_BY_NUMPY: dict[np.dtype[Any], DtypeInfo] = {
    i.numpy_dtype: i for i in DTYPES.values() if i.numpy_dtype is not None
}


def dtype_info(name: str, *, where: str = "tensor") -> DtypeInfo:
    """The :class:`DtypeInfo` of a stable dtype name; ``UnsupportedDtype`` if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedDtype(f"{where}: unsupported dtype {name!r}") from None


def dtype_name(x: torch.Tensor | np.ndarray[Any, Any] | RawTensor | torch.dtype
               | np.dtype[Any], *, where: str = "tensor") -> str:
    """Stable name of the dtype of a tensor, array, :class:`RawTensor` or dtype object."""
    named = getattr(x, "dtype", None)
    if isinstance(named, str):  # a RawTensor, a streamed tensor: the stable name itself
        return dtype_info(named, where=where).name
    torch = _torch_module()
    dt = x.dtype if isinstance(x, np.ndarray) or (
        torch is not None and isinstance(x, torch.Tensor)) else x
    info: DtypeInfo | None
    if torch is not None and isinstance(dt, torch.dtype):
        info = _by_torch().get(dt)
    else:
        ndt = np.dtype(cast(Any, dt))
        info = _BY_NUMPY.get(ndt.newbyteorder("=")) if ndt.isnative else None
    if info is None:
        raise UnsupportedDtype(f"{where}: unsupported dtype {dt} (no fixed-width byte layout)")
    return info.name


def tensor_bytes(x: torch.Tensor | np.ndarray[Any, Any] | RawTensor, *, where: str = "tensor",
                 ) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], str, tuple[int, ...]]:
    """``(read-only uint8 view, dtype name, shape)`` of a tensor, numpy array or
    :class:`RawTensor`.

    Contiguous CPU tensors are viewed without a copy; non-contiguous, conjugated or
    non-CPU tensors are copied first.  The input is never mutated and the returned view is
    read-only so the codec cannot mutate it by accident either.
    """
    torch = _torch_module()
    if isinstance(x, RawTensor):
        arr, name, shape = x.data, x.dtype, x.shape
    elif isinstance(x, np.ndarray):
        name = dtype_name(x, where=where)
        shape = tuple(int(s) for s in x.shape)
        arr = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    elif torch is not None and isinstance(x, torch.Tensor):
        info = _by_torch().get(x.dtype)
        if (info is not None and not x.is_nested and x.layout == torch.strided
                and x.device.type == "cpu" and x.is_contiguous()
                and not (x.is_conj() or x.is_neg())):
            # the common case, a plain CPU tensor, viewed in a few calls (a state of many
            # small tensors pays this per tensor, on the thread that assembles the blob)
            arr = (x.detach().reshape(-1).view(torch.uint8).numpy() if x.numel()
                   else np.empty(0, np.uint8))
            arr.flags.writeable = False
            return arr, info.name, tuple(x.shape)
        if x.layout != torch.strided or x.is_quantized or x.is_nested:
            raise UnsupportedDtype(f"{where}: unsupported tensor layout {x.layout}")
        name = dtype_name(x, where=where)
        shape = tuple(int(s) for s in x.shape)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.contiguous().reshape(-1)
        arr = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    else:
        raise UnsupportedDtype(f"{where}: not a tensor or numpy array: {type(x).__name__}")
    arr = arr.view()
    arr.flags.writeable = False
    return arr, name, shape


def as_torch(x: Any, *, where: str = "tensor") -> Any:
    """``x`` as a torch tensor: a :class:`RawTensor` viewed as one (over the same bytes,
    when they are writable), anything else as it is."""
    if isinstance(x, RawTensor):
        return tensor_from_bytes(x.data, x.dtype, x.shape, where=where)
    return x


def tensor_from_bytes(buf: np.ndarray[Any, Any] | bytes | bytearray | memoryview,
                      dtype_name: str, shape: tuple[int, ...] | list[int], *,
                      where: str = "tensor") -> torch.Tensor:
    """Build a CPU tensor of ``dtype_name``/``shape`` over ``buf`` (no copy when writable)."""
    import torch

    info = dtype_info(dtype_name, where=where)
    if info.torch_dtype is None:
        raise UnsupportedDtype(f"{where}: dtype {dtype_name!r} has no torch equivalent")
    shp = tuple(int(s) for s in shape)
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    arr = arr.reshape(-1)
    n = 1
    for s in shp:
        n *= s
    if arr.dtype != np.uint8 or arr.size != n * info.itemsize:
        raise ShapeMismatch(f"{where}: {arr.size} bytes do not hold {dtype_name}{list(shp)}")
    if n == 0:
        return torch.empty(shp, dtype=info.torch_dtype)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = arr.copy()
    return torch.from_numpy(arr).view(info.torch_dtype).reshape(shp)
