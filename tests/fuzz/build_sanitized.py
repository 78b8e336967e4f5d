"""An ASan + UBSan build of commlib's C code (the same sources and headers as
switch/csrc/build_native.py, the same module commlib._native) for the fuzz targets:

    python tests/fuzz/build_sanitized.py          # -> build/fuzz/_native.abi3.so

tests/fuzz/run.py --sanitized loads it in place of the regular build; Python itself is not
instrumented, so ASan's runtime comes first through LD_PRELOAD (run.py sets it, and
ASAN_OPTIONS=detect_leaks=0: the interpreter's own allocations would read as leaks). Any UBSan
report stops the process (-fno-sanitize-recover), as an ASan one does.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "build" / "fuzz" / "_native.abi3.so"
FLAGS = ["-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def asan_runtime():
    """The path of the compiler's ASan runtime, to LD_PRELOAD."""
    path = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit("the C compiler has no libasan.so (apt-get install gcc or libasan8)")
    return os.path.realpath(path)


def build():
    """switch/csrc/build_native.py's extension, compiled and linked with the sanitizers (through
    CFLAGS/LDFLAGS, which the compiler driver adds to every command)."""
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "switch" / "csrc" / "build_native.py")
    build_native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_native)
    env = {name: os.environ.get(name) for name in ("CFLAGS", "LDFLAGS")}
    os.environ["CFLAGS"] = " ".join(FLAGS)
    os.environ["LDFLAGS"] = "-fsanitize=address,undefined"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            built = build_native.builder(os.path.abspath).compile(tmpdir=tmp, verbose=False)
            TARGET.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(built, TARGET)
    finally:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return TARGET


def fresh():
    """True when the sanitized build is newer than every C source and header."""
    if not TARGET.exists():
        return False
    sources = list((ROOT / "switch" / "csrc").glob("*.[ch]")) + list((ROOT / "commlib" / "csrc").glob("*.[ch]"))
    return all(TARGET.stat().st_mtime >= s.stat().st_mtime for s in sources)


if __name__ == "__main__":
    print(build())
    sys.exit(0)
