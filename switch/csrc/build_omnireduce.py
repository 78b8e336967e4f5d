"""cffi build script (out-of-line API mode) for commlib.switch._omnireduce; omnireduce.h is the
whole interface (the worker's per-tensor call and the aggregator's serve loop release the GIL)."""
import os
import re
from pathlib import Path

from cffi import FFI

here = Path(__file__).resolve().parent


def _cdef():
    """omnireduce.h minus the preprocessor lines, with every #define constant as `...`."""
    text = (here / "omnireduce.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    consts = re.findall(r"^#define\s+(OMR_\w+)\s+\S", text, flags=re.M)
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return "\n".join(f"#define {name} ..." for name in consts) + "\n" + body


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "commlib.switch._omnireduce",
    '#include "omnireduce.h"',
    sources=[os.path.relpath(here / name) for name in
             ("omnireduce_common.c", "omnireduce_worker.c", "omnireduce_aggregator.c")],  # setuptools wants relative paths
    include_dirs=[os.path.relpath(here)],
    depends=[os.path.relpath(here / name) for name in ("omnireduce.h", "omnireduce_internal.h")],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
