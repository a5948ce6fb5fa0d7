"""Build hook: compiles the native kernels (cffi API mode); all metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/build_kernels.py:ffibuilder"])
