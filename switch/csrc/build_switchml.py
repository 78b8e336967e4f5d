"""cffi build script (out-of-line API mode) for commlib.switch._switchml; switchml.h is the whole
interface. The worker reuses commlib's quantization kernels (commlib/csrc/kernels.c) compiled in.

    python switch/csrc/build_switchml.py     # build in place without setup.py
"""
import os
import re
from pathlib import Path

from cffi import FFI

here = Path(__file__).resolve().parent
kernels = here.parent.parent / "commlib" / "csrc"


def _cdef():
    """The header's declarations for cdef: #define constants as `...`, no include guards."""
    lines = []
    for line in (here / "switchml.h").read_text().splitlines():
        if line.startswith("#define SML_"):
            lines.append(f"#define {line.split()[1]} ...")
        elif not line.startswith("#") and not line.lstrip().startswith(("/*", "*")):
            lines.append(re.sub(r"/\*.*?\*/", "", line))
    return "\n".join(lines)


def _builder(path=os.path.relpath):
    ffi = FFI()
    ffi.cdef(_cdef())
    ffi.set_source(
        "commlib.switch._switchml",
        '#include "switchml.h"',
        sources=[path(here / name) for name in ("switchml_switch.c", "switchml_worker.c", "switchml_udp.c")] +
                [path(kernels / "kernels.c")],
        include_dirs=[path(here), path(kernels)],
        extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"],
        libraries=["m", "pthread"],
    )
    return ffi


ffibuilder = _builder()   # setuptools wants relative paths

if __name__ == "__main__":
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        built = _builder(os.path.abspath).compile(tmpdir=tmp, verbose=False)
        for old in here.parent.glob("_switchml.*.so"):
            old.unlink()
        target = here.parent / "_switchml.abi3.so"   # the name setup.py build_ext --inplace gives it
        shutil.copy(built, target)
        print(target)
