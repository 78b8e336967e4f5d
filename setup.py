"""Only here for cffi: switch/csrc/build_native.py defines the one extension, commlib._native
(out-of-line API mode; its cdef is read from the C headers)."""
from setuptools import setup

setup(cffi_modules=["switch/csrc/build_native.py:ffibuilder"])
