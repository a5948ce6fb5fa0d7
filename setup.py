"""Build hook: compiles the native kernels and the rANS plane coder (cffi API mode).

All package metadata lives in pyproject.toml.
"""

from setuptools import setup

setup(cffi_modules=["native/build_kernels.py:ffibuilder", "native/build_rans.py:ffibuilder"])
