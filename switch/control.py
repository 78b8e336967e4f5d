"""The control plane of both daemons, commlib-switch and commlib-aggregator: one message format
and one readiness handshake.

Message: one JSON object in UTF-8, ending in a newline. A request names its operation and carries
its fields, {"op": "register", ...}; the answer is {"ok": true, ...fields} or {"ok": false,
"error": "why, and what to do"}. Over TCP (the switch's control port) the messages of one
connection follow each other line by line; over UDP (an aggregator's port, which it shares with
the data plane) one message is one datagram, told apart from data packets by its first byte `{`
(OMR_CONTROL in switch/csrc/omnireduce.h; no data packet type has that value).

Readiness: a daemon prints one line `READY host:port[,host:port...]` on stdout once every
endpoint serves, and writes the same addresses to a file when given one (--port-file);
`wait_ready` reads the line.
"""
import json
import os
import queue
import threading
import time

from commlib.errors import ConfigError

MARK = b"{"       # the first byte of every control message
READY = "READY"


def encode(message):
    """The bytes of one message (a dict)."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(data):
    """The message in `data` (one line or one datagram), or None if it is not a JSON object."""
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) else None


def answer(handle, request):
    """The answer to `request` (a decoded message, or None): {"ok": True, **handle(request)}, or
    {"ok": False, "error": ...} when it is malformed or `handle` refuses it (ConfigError, or the
    ValueError/KeyError/TypeError of a missing or mistyped field)."""
    if request is None:
        return {"ok": False, "error": 'a request is one JSON object, e.g. {"op": "status"}'}
    try:
        return {"ok": True, **handle(request)}
    except OverflowError as exc:   # cffi: a number beyond its C type that no check caught
        return {"ok": False, "error": f"a number in the request is out of range ({exc})"}
    except KeyError as exc:
        return {"ok": False, "error": f"the request lacks the field {exc}"}
    except (ValueError, TypeError, ConfigError) as exc:
        return {"ok": False, "error": str(exc)}


def result(reply, what):
    """The fields of an answer; a refusal raises ConfigError naming `what` and the reason."""
    if reply is None:
        raise ConfigError(f"{what}: the answer is not a control message")
    if not reply.pop("ok", False):
        raise ConfigError(f"{what}: {reply.get('error', 'refused')}")
    return reply


def announce_ready(addresses, port_file=""):
    """The daemon serves at `addresses` ('host:port' each): say so."""
    text = ",".join(addresses)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(text)
        os.replace(port_file + ".tmp", port_file)
    print(f"{READY} {text}", flush=True)


def wait_ready(proc, seconds, what="the daemon"):
    """The addresses a child daemon announced on its stdout (a text pipe), waiting at most
    `seconds`; RuntimeError with its exit code and its last words otherwise."""
    lines = queue.Queue()

    def read():   # a thread: select() cannot see lines the pipe's reader already buffered
        for line in proc.stdout:
            lines.put(line)
            if line.startswith(READY + " "):
                return
        lines.put(None)

    threading.Thread(target=read, name="commlib-wait-ready", daemon=True).start()
    deadline, said = time.monotonic() + seconds, []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith(READY + " "):
            return line.split()[1].split(",")
        said.append(line.strip())
    raise RuntimeError(f"{what} did not start within {seconds:.0f}s (exit code {proc.poll()}, said {said[-3:]!r})")
