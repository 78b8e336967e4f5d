"""Addresses: the one this host is reached by, and 'host:port' settings."""
import socket

from commlib.errors import ConfigError


def primary_ip():
    """The address other hosts reach this one by (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: connect() on UDP sends no packet
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def parse_address(text, what="address"):
    """'host:port' -> (host, port), or a ConfigError that says what was expected."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} {text!r} must read host:port, e.g. 127.0.0.1:9099")
    return host, int(port)
