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
