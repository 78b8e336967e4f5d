"""Only here for cffi: every `*/csrc/build_*.py` defines an `ffibuilder` (out-of-line API mode)."""
from glob import glob

from setuptools import setup

setup(cffi_modules=[f"{path}:ffibuilder" for path in sorted(glob("*/csrc/build_*.py"))])
