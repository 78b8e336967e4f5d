"""The one cffi build script (out-of-line API mode): commlib._native, every C file of commlib.

Its interface is the headers below, read one way: comments and preprocessor lines dropped, each
`#define NAME value` declared as `#define NAME ...` (the compiler fills the value in), and the C-only
part of a header (between `#ifndef TP_PYTHON_API_ONLY` and its `#endif /* TP_PYTHON_API_ONLY */`,
types built on the socket API) left out.

    python switch/csrc/build_native.py     # build in place without setup.py / pip
"""
import os
import re
from pathlib import Path

from cffi import FFI

here = Path(__file__).resolve().parent
root = here.parent.parent
HEADERS = [root / "commlib" / "csrc" / "kernels.h", here / "transport.h", here / "switchml.h", here / "omnireduce.h"]
SOURCES = [root / "commlib" / "csrc" / "kernels.c"] + [here / name for name in (
    "transport.c", "switchml_switch.c", "switchml_worker.c",
    "omnireduce_common.c", "omnireduce_worker.c", "omnireduce_aggregator.c")]
C_ONLY = re.compile(r"^#ifndef TP_PYTHON_API_ONLY$.*?^#endif /\* TP_PYTHON_API_ONLY \*/$", re.S | re.M)


def cdef_of(header):
    """What cffi declares for one header (see the module docstring)."""
    text = C_ONLY.sub("", Path(header).read_text())
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        define = re.match(r"#define\s+(\w+)\s+\S", line)
        if define:
            lines.append(f"#define {define.group(1)} ...")
        elif not line.lstrip().startswith("#"):
            lines.append(line)
    return "\n".join(lines)


def libcrypto_archive():
    """OpenSSL's static libcrypto.a, where libssl-dev puts it (pkg-config's libdir, then the usual ones)."""
    import subprocess
    dirs = []
    try:
        dirs.append(subprocess.run(["pkg-config", "--variable=libdir", "libcrypto"], capture_output=True,
                                   text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib64",
             "/usr/local/lib"]
    for d in dirs:
        if d and (Path(d) / "libcrypto.a").is_file():
            return str(Path(d) / "libcrypto.a")
    raise SystemExit("commlib's C data path links OpenSSL's libcrypto.a: install it (apt: libssl-dev)")


def builder(path=os.path.relpath):
    """setuptools wants relative paths; a build from elsewhere, absolute ones."""
    ffi = FFI()
    ffi.cdef("\n".join(cdef_of(h) for h in HEADERS))
    ffi.set_source(
        "commlib._native",
        "\n".join(f'#include "{h.name}"' for h in HEADERS),
        sources=[path(s) for s in SOURCES],
        include_dirs=sorted({path(h.parent) for h in HEADERS}),
        depends=[path(h) for h in HEADERS] + [path(here / n) for n in ("switchml_common.h", "omnireduce_internal.h")],
        extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-Wall", "-Wno-unused-function"],
        libraries=["m", "pthread"],
        # OpenSSL's libcrypto (the packet MAC; apt: libssl-dev) linked in with its symbols hidden: a
        # process that loaded TensorFlow's BoringSSL with RTLD_GLOBAL (horovod.tensorflow does) would
        # otherwise bind our EVP_* calls to BoringSSL's, which has no EVP_chacha20_poly1305
        extra_objects=[libcrypto_archive()],
        extra_link_args=["-Wl,--exclude-libs,ALL"],
    )
    return ffi


ffibuilder = builder()

if __name__ == "__main__":
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        built = builder(os.path.abspath).compile(tmpdir=tmp, verbose=False)
        target = root / "commlib" / "_native.abi3.so"   # the name setup.py build_ext --inplace gives it
        shutil.copy(built, target)
        print(target)
