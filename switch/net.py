"""UDP sockets of the data planes: SwitchML's switch and workers, OmniReduce's workers and aggregators."""
import errno
import ipaddress
import socket

from commlib.errors import ConfigError

# (privileged option that may exceed net.core.rmem_max / wmem_max, the plain one the kernel caps)
_BUFFER_OPTIONS = ((getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
                   (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF))


def udp_socket(host=None, port=0, buffer_bytes=4 << 20):
    """An IPv4 UDP socket whose receive and send buffers hold `buffer_bytes` (a window of packets),
    bound to (host, port) when a host is given. Raises OSError (the socket closed) if it cannot bind."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for options in _BUFFER_OPTIONS:
            for option in options:   # the forced size where we may, else what the kernel allows
                try:
                    sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
                    break
                except OSError:
                    continue
        if host is not None:
            sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def path_mtu(sock, default=1500):
    """The MTU of the path of a connected socket (Linux's IP_MTU: the route's device or the path MTU
    the kernel learned), or `default` where the kernel does not say."""
    try:
        return sock.getsockopt(socket.IPPROTO_IP, getattr(socket, "IP_MTU", 14))
    except OSError:
        return default


def path_mtu_to(address, default=1500):
    """The MTU of the path to (ip, port): path_mtu of a UDP socket connected there (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
        except OSError:
            return default
        return path_mtu(sock, default)


def path_values(mtu, overhead, most):
    """The most 4-byte values whose datagram (plus `overhead` bytes: headers, stamp, MAC) fits one
    IPv4 packet of this MTU unfragmented, within 1..most."""
    return max(1, min(most, (mtu - 28 - overhead) // 4))   # 28: IPv4 and UDP headers


def is_broadcast(host):
    """Whether this host's routes make the IPv4 address `host` a broadcast one: 255.255.255.255 or the
    directed broadcast of a subnet of one of its interfaces (10.0.0.255 on 10.0.0.0/24). The kernel
    says so itself: a UDP socket without SO_BROADCAST may not connect there (EACCES; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((str(host), 9))
        except OSError as exc:
            return exc.errno == errno.EACCES
    return False


def unicast(host, what):
    """The IPv4 address `host` (a literal) if it names one host, else ConfigError: not multicast,
    unspecified, reserved (240/4, 255.255.255.255) nor a subnet's broadcast address (is_broadcast),
    where a packet would reach every host of the subnet, or none."""
    try:
        ip = ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(f"{what} {str(host)[:60]}: not an IPv4 address") from None
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        raise ConfigError(f"{what} {ip}: not a unicast IPv4 address (multicast, unspecified or reserved); "
                          f"give the address of one host")
    if is_broadcast(ip):
        raise ConfigError(f"{what} {ip}: the broadcast address of a subnet of this host, not a unicast one "
                          f"(its packets would go to every host there); give the address of one host")
    return ip
