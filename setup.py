"""Build hook: compiles the native kernels and the rANS plane coder (cffi API mode).

All package metadata lives in pyproject.toml. The two extension modules use only the stable
ABI (cffi builds them with ``Py_LIMITED_API``), so the wheel is tagged ``cp311-abi3``: one
wheel per platform serves every CPython from 3.11 on.
"""

from setuptools import setup

setup(
    cffi_modules=["native/build_kernels.py:ffibuilder", "native/build_rans.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
