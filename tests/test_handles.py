"""commlib/handles.py: a Handle's done-callbacks."""
import commlib
from commlib.handles import Handle


def test_a_handle_calls_back_when_it_resolves_or_at_once_if_it_has():
    seen = []
    pending, failed = Handle("p", 1.0), Handle("f", 1.0)
    pending.add_done_callback(lambda h: seen.append(("p", h.wait())))
    assert seen == []
    pending.set(result=7)
    failed.set(error=commlib.CommError("gone"))
    failed.add_done_callback(lambda h: seen.append(("f", h.done())))
    assert seen == [("p", 7), ("f", True)]


def test_every_waiter_gets_the_result_and_a_bounded_wait_says_not_yet():
    import threading

    handle = Handle("t", 5.0)
    assert not handle.done() and not handle.done(wait_s=0.05)
    got = []
    waiters = [threading.Thread(target=lambda: got.append(handle.wait())) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    handle.set(result=7)
    for waiter in waiters:
        waiter.join(5.0)
    assert got == [7] * 4, got
    assert handle.done() and handle.done(wait_s=1.0) and handle.wait() == 7


def test_a_handle_that_never_resolves_times_out_naming_its_tensor():
    handle = Handle("layer.weight", 0.05)
    try:
        handle.wait()
    except commlib.CommTimeout as exc:
        assert "layer.weight" in str(exc), exc
    else:
        raise AssertionError("wait() returned without a result")


def test_a_result_is_restored_once_on_the_first_thread_that_waits_and_raw_until_then():
    import threading

    handle, calls = Handle("t", 5.0), []
    handle.set(result=[1, 2], restore=lambda raw: calls.append(threading.current_thread().name) or tuple(raw))
    assert handle.wait(restored=False) == [1, 2] and calls == [], "the backend's result, not restored"
    waiters = [threading.Thread(target=handle.wait, name=f"waiter{i}") for i in range(3)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(5.0)
    assert handle.wait() == (1, 2) and len(calls) == 1 and calls[0].startswith("waiter"), calls
    assert handle.wait(restored=False) == (1, 2), "once restored, the result"
