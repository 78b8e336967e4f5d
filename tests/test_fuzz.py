"""The fuzz targets of tests/fuzz (atheris), a short bounded run each: the control targets in
`make test`, the packet targets (ASan + UBSan build) in `make test-long`. A crash (a handler raising
past `answer`, an error counted as "internal", leaked slots, an ASan or UBSan report from the C
packet handlers, a controller that admits a stranger or keeps its connection) fails the test with the
fuzzer's output and the crashing input.
`make fuzz` runs the same targets for minutes with a corpus (tests/fuzz/run.py says how)."""
import pytest


from helpers import fuzz

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("target", ["controller_hello", "switch_control", "aggregator_control"])
def test_control_handlers(tmp_path, target):
    rc, log = fuzz(tmp_path, target, "-runs=3000", "-max_total_time=30")
    assert rc == 0 and "Done 3000 runs" in log, log[-3000:]


@pytest.mark.long
@pytest.mark.parametrize("target", ["switch_packets", "aggregator_packets"])
def test_packet_handlers_under_asan_and_ubsan(tmp_path, target):
    rc, log = fuzz(tmp_path, target, "--sanitized", "-runs=1500", "-max_total_time=30")
    assert rc == 0 and "Done 1500 runs" in log, log[-3000:]


@pytest.mark.long
def test_the_sanitized_build_reports_memory_errors(tmp_path):
    """The packet runs above prove something only if the C code they run is instrumented."""
    rc, log = fuzz(tmp_path, "asan_selftest", "--sanitized", "-runs=1")
    assert rc != 0 and "heap-buffer-overflow" in log, log[-3000:]


def test_the_control_fuzzer_finds_a_planted_bug(tmp_path):
    """The control runs above prove something only if a handler's unforeseen exception is a crash."""
    rc, log = fuzz(tmp_path, "switch_control", "-runs=200000", "-max_total_time=60",
                   env={"COMMLIB_FUZZ_PLANTED_BUG": "1"})
    assert rc != 0 and "nobody foresaw" in log and list(tmp_path.glob("crash-*")), log[-3000:]
