"""commlib/executor.py through one process: a tensor name in flight at most once (a refused
submission leaves nothing behind), a bucket of adjacent views fused without a copy, and one record
for all unnamed calls (memory stays flat)."""
import contextlib
import gc
import sys
import tracemalloc

import numpy as np
import pytest

import commlib
from commlib.executor import fused
from helpers import single_process


def test_duplicate_name_in_flight(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    commlib.init(policy="*=ring", cycle_time_ms=1000)   # the controller holds "dup" for up to a second
    try:
        handle = commlib.allreduce_async(np.ones(4, np.float32), name="dup")
        with pytest.raises(commlib.ConfigError, match="already in flight"):
            commlib.allreduce_async(np.ones(4, np.float32), name="dup")
        commlib.synchronize(handle)
    finally:
        commlib.shutdown()


def test_a_refused_group_leaves_nothing_in_flight(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    commlib.init(policy="*=ring", cycle_time_ms=1000)   # the controller holds "dup" for up to a second
    try:
        handle = commlib.allreduce_async(np.ones(4, np.float32), name="dup")
        for names in (["a", "dup"], ["a", "b", "b"]):
            with pytest.raises(commlib.ConfigError, match="already in flight"):
                commlib.grouped_allreduce_async([np.ones(4, np.float32)] * len(names), names=names)
        handles = commlib.grouped_allreduce_async([np.ones(4, np.float32)] * 2, names=["a", "b"])
        assert [commlib.synchronize(h).tolist() for h in [handle, *handles]] == [[1.0] * 4] * 3
    finally:
        commlib.shutdown()


def test_a_bucket_of_adjacent_views_is_fused_without_a_copy():
    flat = np.arange(10, dtype=np.float32)
    a, b = flat[:3], flat[3:]
    together = fused([a, b])
    assert np.shares_memory(together, flat) and together.tolist() == flat.tolist()
    assert not together.flags.writeable, "the caller's memory must not be written by the backends"
    assert fused([b, a]) is None and fused([a, flat[4:]]) is None, "non-adjacent arrays need a copy"
    assert fused([a, flat[3:].astype(np.float64)]) is None


@pytest.mark.long
def test_unnamed_calls_keep_memory_flat(monkeypatch):
    """Each unnamed call travels under a name of its own, but they share one record: memory stays
    flat over many calls (it grew by about 1 KB a call, a record per call)."""
    single_process(monkeypatch)
    commlib.init(policy="*=ring", timeout_s=5.0)
    try:
        x = np.ones(64, np.float32)
        for _ in range(200):
            commlib.allreduce(x)
        gc.collect()
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(3000):
                commlib.allreduce(x)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - start
        finally:
            tracemalloc.stop()
        assert list(commlib.records()) == ["allreduce.noname"], list(commlib.records())[:5]
        assert grown < 3000 * 100, f"{grown} bytes more after 3000 unnamed calls ({grown / 3000:.0f} per call)"
    finally:
        commlib.shutdown()


def test_records_can_be_read_while_the_executor_adds_a_name():
    """commlib.records() copies the records while commlib's thread records new names."""
    from commlib.dispatch import Plan
    from commlib.executor import Records
    records = Records()
    records.put("a", "ring", Plan(((None, "ring"),)), "float32", 4, None, 0.0, 0.0, {"bucket": "a"})
    names = iter(records)
    records.put("b", "ring", Plan(((None, "ring"),)), "float32", 4, None, 0.0, 0.0, {"bucket": "b"})
    assert list(names) == ["a"] and dict(records)["b"]["bucket"] == "b"
    assert records["a"] is records["a"], "the same run reads as the same dict"


def test_a_whole_buckets_record_stands_for_its_parameters_each_keeping_its_own_auto():
    """Records.stand_for (commlib.torch.ddp._stand_for): the bucket's record is each parameter's, whose
    `auto` (from a run as the executor put it, or a record set whole) stays where the bucket's has none."""
    from commlib.dispatch import Plan
    from commlib.executor import Records
    records, plan, kept = Records(), Plan(((None, "ring"),)), {"choice": "ring", "revisit": 500}
    records.put("w", "switchml", plan, "float32", 4, None, 0.0, 0.0, {"bucket": "w"}, auto=kept)   # as put
    records["b"] = {"algorithm": "ring", "auto": {"trial": 3}}                                     # set whole
    records.put("c", "ring", plan, "float32", 4, None, 0.0, 0.0, {"bucket": "c"})                  # no auto
    bucket = {"algorithm": "ring", "bucket": "bucket(w+2)"}
    records["bucket(w+2)"] = bucket
    records.stand_for("bucket(w+2)", ["w", "b", "c"])
    assert records["w"] == {**bucket, "auto": kept}, records["w"]
    assert records["b"] == {**bucket, "auto": {"trial": 3}}, records["b"]
    assert records["c"] is records["bucket(w+2)"], records["c"]
    own = {**bucket, "auto": {"choice": "switchml"}}   # a bucket auto planned itself: its own record, as is
    records["bucket(w+2)"] = own
    records.stand_for("bucket(w+2)", ["w", "b"])
    assert records["w"] is own and records["b"] is own
    records.stand_for("never ran", ["w"])
    assert records["w"] is own, "a bucket without a record changes nothing"


@contextlib.contextmanager
def switching_often():
    """Threads switch between nearly every two bytecodes: a race a busy host shows once in many runs
    (CI's did) shows in most."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_a_bounded_name_table_can_be_put_to_while_another_thread_pops():
    import threading
    from commlib import recent
    names, errors, done = {}, [], threading.Event()

    def take():   # trials.Reports: the executor puts a report, the caller's thread takes it
        while not done.is_set():
            for step in range(0, 3000, 7):
                names.pop(f"loss.{step}", None)

    taker = threading.Thread(target=take)
    with switching_often():
        taker.start()
        try:
            for step in range(3000):
                recent.put(names, f"loss.{step}", step, 100)
        except RuntimeError as exc:
            errors.append(exc)
        finally:
            done.set()
            taker.join(10)
    assert not errors and len(names) <= 100, (errors[:1], len(names))


def test_records_of_a_program_that_makes_up_names_stay_bounded_and_keep_the_names_of_every_step(monkeypatch):
    import threading
    from commlib import executor
    from commlib.dispatch import Plan
    monkeypatch.setattr(executor, "RECORDS_KEPT", 100)
    records, plan, errors = executor.Records(), Plan(((None, "ring"),)), []
    for step in range(1000):
        records.put("w", "ring", plan, "float32", 4, None, 0.0, 0.0, {})   # every step
        for i in range(30):   # and 30 made-up names
            records.put(f"loss.{step}.{i}", "ring", plan, "float32", 4, None, 0.0, 0.0, {})
        assert "w" in records.snapshot(), f"step {step}: the name of every step was dropped"

    def put(prefix):   # two executors (the job's and a process set's) into one Records, a user reading it
        try:
            for step in range(3000):
                records.put(f"{prefix}.loss.{step}", "ring", plan, "float32", 4, None, 0.0, 0.0, {})
        except Exception as exc:
            errors.append(exc)

    writers = [threading.Thread(target=put, args=(prefix,)) for prefix in ("job", "set")]
    with switching_often():
        for writer in writers:
            writer.start()
        while any(writer.is_alive() for writer in writers):
            records.snapshot()   # makes each record's dict, as a reader does
    records.put("last", "ring", plan, "float32", 4, None, 0.0, 0.0, {})
    assert not errors and len(records) <= 100 and len(records._made) <= 100, (errors[:1], len(records), len(records._made))
