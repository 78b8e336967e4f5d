"""Run one fuzz target of tests/fuzz/targets.py under atheris (libFuzzer).

    python tests/fuzz/run.py TARGET [--sanitized] [libFuzzer flags]
    python tests/fuzz/run.py switch_packets --sanitized -runs=5000 -max_total_time=60
    python tests/fuzz/run.py switch_control -max_total_time=600 corpus/switch_control   # keeps a corpus

TARGET: controller_hello, switch_control, aggregator_control, switch_packets, switch_leaf_packets,
aggregator_packets. --sanitized runs the C code of tests/fuzz/build_sanitized.py (built when missing
or stale) with ASan's runtime preloaded: the process re-executes itself with LD_PRELOAD=<libasan.so>
ASAN_OPTIONS=detect_leaks=0. gcc's ASan runtime then provides the coverage hooks instead of atheris'
libFuzzer, so a sanitized run is not coverage-guided: use it for the packet targets (whose inputs
are built field by field, so they reach aggregation, results and replays anyway) and the plain run,
guided by the coverage of the Python handlers, for the control targets. The C code is not
coverage-instrumented in either (that takes clang's -fsanitize=fuzzer-no-link; gcc has no
equivalent).
A crash (an exception from the target, an ASan or UBSan report) ends the run with a non-zero exit
code and leaves the input as crash-* in the working directory (libFuzzer's -artifact_prefix=).
"""
import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _sanitized_native():
    """Make `commlib._native` the sanitized build, before anything imports the regular one."""
    import build_sanitized
    spec = importlib.util.spec_from_file_location("commlib._native", build_sanitized.TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["commlib._native"] = module


def main(argv):
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    target, args = argv[0], [a for a in argv[1:] if a != "--sanitized"]
    if "--sanitized" in argv:
        import build_sanitized
        runtime = build_sanitized.asan_runtime()
        if runtime not in os.environ.get("LD_PRELOAD", ""):
            if not build_sanitized.fresh():
                build_sanitized.build()
            env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1",
                       UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
            os.execve(sys.executable, [sys.executable, __file__, *argv], env)
        _sanitized_native()
    import atheris
    import targets
    functions = {**targets.TARGETS, **targets.SELFTESTS}
    if target not in functions:
        sys.exit(f"unknown target {target!r}; one of {', '.join(targets.TARGETS)}")
    atheris.Setup([sys.argv[0], *args], functions[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv[1:])
