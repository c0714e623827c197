"""Hosts for tests: Linux network namespaces joined by one bridge, as machines on one private /24.

`hosts(["a", "p", ...])` makes one network namespace per host, each with its own veth into a
bridge in the root namespace: the host's address is `10.213.N.<i+1>/24`, its loopback is up and
it has no default route (nothing beyond the /24 is reachable from it). The bridge holds `.254`,
so this process (root namespace) reaches every host as a client on the network would. A host
runs commands through `ip netns exec`; `cut(host)` sets its root-side veth down (a partition:
no RST, no FIN, packets just stop), `restore(host)` sets it up again. `netem(host, peers,
...)` adds latency and loss between one host and others, where the kernel has sch_netem.

Names carry this process's id and a per-process sequence number, so parallel runs don't
collide; the /24 is picked under a lock file among the ones no address or route of the machine
uses. Teardown removes exactly what was made: every process in the namespaces (SIGTERM, then
SIGKILL), the namespaces, the veths, the bridge; also when the test failed.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

SUBNET_PREFIX = "10.213"  # the /24s are 10.213.N.0/24, N free on the machine
BRIDGE_HOST = 254  # the bridge's (root namespace's) address on each /24
LOCK_FILE = "/tmp/pdserve-netns.lock"
NETEM_UNKNOWN = "Specified qdisc kind is unknown"
TERM_GRACE_S = 2.0
_sequence = itertools.count()


def unusable() -> str | None:
    """Why this machine cannot make hosts here, or None (a namespace and a bridge are made
    and removed to find out: root in a container may still lack the capabilities)."""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (network namespaces, veths, a bridge)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths and a bridge)"
    tag = f"{os.getpid()}{next(_sequence)}"
    for kind, add, remove in (
            ("a network namespace", ("netns", "add", f"pdserve-probe-{tag}"),
             ("netns", "del", f"pdserve-probe-{tag}")),
            ("a bridge", ("link", "add", f"pq{tag}", "type", "bridge"),
             ("link", "del", f"pq{tag}"))):
        made = _ip(*add, check=False, quiet=True)
        if made.returncode != 0:
            return f"cannot make {kind} here: {made.stderr.strip()}"
        _ip(*remove, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # the test's name for it: "a", "p", "d1" ...
    netns: str  # its network namespace
    address: str  # its address on the /24
    veth: str  # the root-side end of its link (in the bridge)


class Network:
    """Hosts on one bridge; built and torn down by `hosts`."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"host names must be 1-200 distinct names, got {list(names)}")
        tag = f"{os.getpid()}{next(_sequence)}"  # <= 7 + 2 digits: interface names <= 15
        self.bridge = f"pb{tag}"
        self.hosts: dict[str, Host] = {}
        self._names, self._tag = list(names), tag
        self.subnet = ""
        self._made: list[tuple[str, ...]] = []  # ("netns", name) | ("link", name), in order
        self._popens: list[subprocess.Popen] = []

    # ---- build and tear down ----

    def build(self) -> None:
        with open(LOCK_FILE, "a") as lock:  # the /24 is free until our bridge holds it
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.subnet}.{BRIDGE_HOST}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            self.hosts[name] = self._add_host(i, name)

    def _add_host(self, i: int, name: str) -> Host:
        netns = f"pdserve-{self._tag}-{name}"
        veth, peer = f"pv{self._tag}x{i}", f"pn{self._tag}x{i}"  # <= 14 characters
        _ip("netns", "add", netns)
        self._made.append(("netns", netns))
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        self._made.append(("link", veth))
        _ip("link", "set", peer, "netns", netns)
        address = f"{self.subnet}.{i + 1}"
        _ip("-n", netns, "link", "set", peer, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        return Host(name, netns, address, veth)

    def close(self) -> None:
        """Remove everything made, newest first; every process in a namespace goes first."""
        namespaces = [made[1] for made in self._made if made[0] == "netns"]
        _stop_processes(namespaces)
        for popen in self._popens:  # reap ours (killed above with their namespace)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:  # a veth whose namespace end went with its namespace is gone already
                _ip("link", "del", name, check=False, quiet=True)
        self._made.clear()

    # ---- running things in a host ----

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """`argv` started in `host` (its processes are stopped at teardown whatever happens)."""
        popen = subprocess.Popen(self.command(host, argv), **kwargs)
        self._popens.append(popen)
        return popen

    def run(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)

    def pids(self, host: str) -> list[int]:
        """Every process in the host's network namespace."""
        return _netns_pids(self.hosts[host].netns)

    # ---- faults ----

    def cut(self, host: str) -> None:
        """Partition `host` from every other (its link down; connections stay half-open)."""
        _ip("link", "set", self.hosts[host].veth, "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].veth, "up")

    @contextlib.contextmanager
    def partitioned(self, host: str) -> Iterator[None]:
        self.cut(host)
        try:
            yield
        finally:
            self.restore(host)

    @contextlib.contextmanager
    def netem(self, host: str, peers: Sequence[str], delay_ms: float, jitter_ms: float = 0.0,
              loss_pct: float = 0.0) -> Iterator[None]:
        """Latency (± jitter) and loss on every packet between `host` and each of `peers`, both
        ways; every other path untouched. Skips the test where the kernel has no sch_netem."""
        routes = {host: [self.hosts[p].address for p in peers]}
        routes |= {p: [self.hosts[host].address] for p in peers}
        shaped: list[str] = []
        try:
            for src, dsts in routes.items():
                shaped.append(src)
                self._shape(src, dsts, delay_ms, jitter_ms, loss_pct)
            yield
        finally:
            for src in shaped:
                self._tc(src, "qdisc", "del", "dev", "eth0", "root", check=False)

    def _shape(self, host: str, dsts: Sequence[str], delay_ms: float, jitter_ms: float,
               loss_pct: float) -> None:
        # an htb root whose default class takes every packet but those the u32 filter sends
        # (to `dsts`) to the second class, the only one with netem under it; both classes far
        # above any rate here, so only netem shapes (htb, not prio: some kernels lack sch_prio)
        self._tc(host, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default",
                 "10")
        for classid in ("1:10", "1:20"):
            self._tc(host, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid,
                     "htb", "rate", "100gbit", "quantum", "60000")
        netem = self._tc(host, "qdisc", "add", "dev", "eth0", "parent", "1:20", "handle", "20:",
                         "netem", "delay", f"{delay_ms}ms", f"{jitter_ms}ms", "loss",
                         f"{loss_pct}%", check=False)
        if netem.returncode != 0:
            self._tc(host, "qdisc", "del", "dev", "eth0", "root", check=False)
            if NETEM_UNKNOWN in netem.stderr:
                pytest.skip(f"the kernel lacks sch_netem (tc: {netem.stderr.strip()})")
            raise RuntimeError(f"tc netem in {host}: {netem.stderr.strip()}")
        for dst in dsts:
            self._tc(host, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst", f"{dst}/32", "flowid", "1:20")

    def _tc(self, host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        if shutil.which("tc") is None:
            pytest.skip("needs iproute2's `tc` for latency and loss (netem)")
        done = subprocess.run(["ip", "netns", "exec", self.hosts[host].netns, "tc", *args],
                              capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} in {host}: {done.stderr.strip()}")
        return done


@contextlib.contextmanager
def hosts(names: Sequence[str]) -> Iterator[Network]:
    """One host per name on one fresh bridge; all of it gone afterwards, whatever happened."""
    network = Network(names)
    try:
        network.build()
        yield network
    finally:
        network.close()


def _ip(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    if done.returncode != 0 and not quiet:
        print(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _free_subnet() -> str:
    """The first 10.213.N (from a start this process's id picks) no address or route uses."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    start = os.getpid() % 250
    for n in itertools.chain(range(start, 250), range(start)):
        if f"{SUBNET_PREFIX}.{n}." not in used:
            return f"{SUBNET_PREFIX}.{n}"
    raise RuntimeError(f"no free /24 left under {SUBNET_PREFIX}.0.0/16")


def _netns_pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False, quiet=True)
    return [int(p) for p in done.stdout.split()]


def _stop_processes(namespaces: Sequence[str]) -> None:
    """Every process in `namespaces`: SIGTERM, then SIGKILL whatever is left after a grace."""
    for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 10.0)):
        left = [pid for ns in namespaces for pid in _netns_pids(ns)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + grace
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = [pid for ns in namespaces for pid in _netns_pids(ns)]
        if not left:
            return
    print(f"processes left in {list(namespaces)} after SIGKILL: {left}")
