"""Per-name state kept bounded: a program that makes up names (name=f"loss.{step}") would otherwise
grow it by a name a step for good."""


def put(names, name, value, most):
    """names[name] = value, as the newest entry (a name that comes every step stays); past `most`
    entries the least recently put quarter goes. Returns the names dropped. Safe beside another
    thread's pop or put: the names are copied in one call (an iterator made in one step and read in
    the next saw another thread's change: 'dictionary changed size during iteration'), and the
    oldest popped, not deleted."""
    names.pop(name, None)
    names[name] = value
    if len(names) <= most:
        return ()
    dropped = list(names)[:max(1, most // 4)]
    for old in dropped:
        names.pop(old, None)
    return dropped
