"""An emulated cluster on one machine, with real kernel networking.

Every host is a network namespace with one interface, `eth0`, whose veth peer sits on a bridge in
a fabric namespace; each host link is shaped in both directions with tc (tbf at `rate`, behind an
optional netem for delay and loss), so a host's uplink and downlink are its port on the emulated
switch. Nothing touches the root namespace: addresses (10.201.0.0/24) exist only inside these
namespaces (each with its own /etc/hosts, see _add_host), and everything is removed on exit, also
on failure.

    with Cluster(["w0", "w1", "switch"], rate="1gbit") as cluster:
        proc = cluster.popen("w0", ["python", "worker.py"])
        cluster.address("switch")   # '10.201.0.3'

Needs root and iproute2 (`make install` brings it).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.201.0"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available():
    """(True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "the emulated cluster needs root (network namespaces, tc)"
    probe = f"clprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, f"cannot create network namespaces: {getattr(exc, 'stderr', exc)}"
    return True, ""


class Cluster:
    """Hosts by name, in order; host i gets address 10.201.0.(i+1)."""

    def __init__(self, hosts, rate="1gbit", delay_ms=0.0, loss_percent=0.0, unshaped=()):
        self.hosts = list(hosts)
        self.rate, self.delay_ms, self.loss_percent = rate, delay_ms, loss_percent
        self.unshaped = set(unshaped)   # e.g. the switch: its ports are the hosts' links
        self.prefix = f"cl{os.getpid()}"
        self.fabric = f"{self.prefix}-fabric"
        self._made = []

    def namespace(self, host):
        return f"{self.prefix}-{host}"

    def address(self, host):
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def popen(self, host, argv, **kwargs):
        """A process inside `host`'s namespace (its own process group, for a clean kill)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], start_new_session=True,
                                **kwargs)

    def run(self, hosts, argv, env, timeout, cwd=None):
        """argv on each of `hosts` at once, rank = position, with torchrun's variables (each worker its
        own host; rank 0's address is MASTER_ADDR; Gloo on eth0). Returns [(exit code, output)];
        past `timeout` every process is killed and RuntimeError says so, with their output."""
        base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
                    WORLD_SIZE=str(len(hosts)), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR=self.address(hosts[0]), MASTER_PORT="29511",
                    GLOO_SOCKET_IFNAME="eth0", **env)   # else Gloo takes the address of the hostname
        procs = [self.popen(host, argv, env=dict(base, RANK=str(rank)), cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank, host in enumerate(hosts)]
        deadline, outputs = time.monotonic() + timeout, []
        try:
            for proc in procs:
                try:
                    outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    self.kill(procs)
                    rest = [proc.communicate()[0] for proc in procs[len(outputs):]]
                    raise RuntimeError(f"{argv} on {len(hosts)} emulated hosts hung past {timeout}s:\n" + "\n".join(
                        f"--- rank {r} ---\n{out[-3000:]}" for r, out in enumerate(outputs + rest))) from None
        finally:
            self.kill(procs)
        return [(proc.returncode, out) for proc, out in zip(procs, outputs)]

    @staticmethod
    def kill(procs):
        """Kill each process group still running, and reap it."""
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:   # it ended meanwhile
                    pass
                proc.wait()

    def start_switch(self, host, cwd=None, seconds=30, extra=()):
        """A commlib-switch serving on `host`'s address, with `extra` options: (its process, 'address:port')."""
        port_file = Path(tempfile.mkdtemp()) / "port"
        proc = self.popen(host, [sys.executable, "-m", "commlib.switch", "--host", self.address(host), "--port", "0",
                                 "--port-file", str(port_file), *extra], stdout=subprocess.DEVNULL,
                          stderr=subprocess.STDOUT, cwd=cwd)
        deadline = time.monotonic() + seconds
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill([proc])
                raise RuntimeError(f"commlib-switch did not start on {host} (exit {proc.poll()})")
            time.sleep(0.05)
        return proc, port_file.read_text()

    def counters(self, host):
        """(tx_bytes, rx_bytes) of the host's link, as its kernel counts them."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(host), "cat",
                              "/sys/class/net/eth0/statistics/tx_bytes", "/sys/class/net/eth0/statistics/rx_bytes"],
                             check=True, capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])

    def __enter__(self):
        try:
            self._add_namespace(self.fabric)
            _ip("-n", self.fabric, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.fabric, "link", "set", "br0", "up")
            for index, host in enumerate(self.hosts):
                self._add_host(index, host)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for namespace in reversed(self._made):   # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        self._made = []

    def _add_namespace(self, namespace):
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")

    def _add_host(self, index, host):
        namespace, port = self.namespace(host), f"p{index}"
        self._add_namespace(namespace)
        _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.fabric)
        _ip("-n", self.fabric, "link", "set", port, "master", "br0")
        _ip("-n", self.fabric, "link", "set", port, "up")
        _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "route", "add", "default", "dev", "eth0")   # so a host finds its own address
        # `ip netns exec` mounts /etc/netns/<ns>/hosts on /etc/hosts: inside, this machine's hostname is
        # the host's own address (Horovod's Gloo process sets look their address up by hostname)
        etc = Path("/etc/netns") / namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(host)} {socket.gethostname()} {host}\n")
        if host not in self.unshaped:
            self._shape(namespace, "eth0")       # uplink: host -> fabric
            self._shape(self.fabric, port)       # downlink: fabric -> host

    def _shape(self, namespace, device):
        # burst above a 64 KiB GSO segment; the queue holds 50 ms at the link rate
        tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if self.delay_ms or self.loss_percent:
            subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms",
                            "loss", f"{self.loss_percent}%", "limit", "100000"], check=True, capture_output=True)
            subprocess.run([*tc, "parent", "1:1", "handle", "10:", *tbf], check=True, capture_output=True)
        else:
            subprocess.run([*tc, "root", *tbf], check=True, capture_output=True)
