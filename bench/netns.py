"""A shaped network on one machine: network namespaces joined by veth pairs to a bridge, each link held to a
rate by a token bucket (``tc ... tbf``) in both directions. This kernel has no netem: latency is not shaped.

    with ShapedNet(3, rate_mbit=100) as net:
        subprocess.run([*net.prefix(0), "ping", "-c1", net.address(1)])

Everything lives in namespaces this process makes and removes (``p2pt-*``), on private addresses of
:data:`SUBNET` that nothing outside them routes: no packet leaves them. Needs root (``ip``, ``tc``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType

SUBNET = "10.77.0"
"""Addresses SUBNET.1, SUBNET.2... of the peers' namespaces (a /24 on the bridge)."""


class NetError(RuntimeError):
    pass


def available() -> str | None:
    """Why a shaped network cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on this machine (iproute2)"
    return None


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")


def remove_leftovers() -> None:
    """Remove the namespaces of an earlier run whose process is gone (killed before it could)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        parts = name.split("-")
        if (
            len(parts) == 3
            and parts[0] == "p2pt"
            and parts[1].isdigit()
            and not os.path.exists(f"/proc/{parts[1]}")
        ):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class ShapedNet:
    """``peers`` namespaces on a bridge, every link shaped to ``rate_mbit`` each way (None: not shaped)."""

    def __init__(self, peers: int, rate_mbit: float | None, *, tag: str | None = None):
        if (why := available()) is not None:
            raise NetError(why)
        self.peers, self.rate_mbit = peers, rate_mbit
        self.tag = tag or str(os.getpid())
        self.hub = f"p2pt-{self.tag}-hub"
        self._made: list[str] = []

    def name(self, index: int) -> str:
        return f"p2pt-{self.tag}-{index}"

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def prefix(self, index: int) -> list[str]:
        """The command prefix that runs a command inside peer ``index``'s namespace."""
        return ["ip", "netns", "exec", self.name(index)]

    def __enter__(self) -> ShapedNet:
        remove_leftovers()
        try:
            self._add_ns(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.peers):
                ns, outer = self.name(i), f"v{i}"
                self._add_ns(ns)
                _run(
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    outer,
                    "netns",
                    self.hub,
                )
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", outer, "up")
                if self.rate_mbit is not None:
                    self._shape(ns, "eth0")  # what the peer sends
                    self._shape(self.hub, outer)  # what it receives
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate = self.rate_mbit
        assert rate is not None
        # The bucket holds a few milliseconds of the rate (at least 64 kB, for the kernel's large segments);
        # a packet may queue 100 ms before it is dropped.
        burst_kb = max(64, int(rate * 1e6 / 8 / 1000 * 4 / 1000))
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{rate}mbit", "burst", f"{burst_kb}kb", "latency", "100ms")  # fmt: skip

    def behind_nat(self, index: int) -> None:
        """No connection can be opened to peer ``index`` any more, as behind a home router's NAT: it dials out
        as before, and a dial to it goes unanswered (its SYN-ACKs are dropped) until the dialer times out.

        This kernel has neither netfilter nor tc's actions: an htb class whose fifo holds no packet takes
        every TCP segment with SYN and ACK set that the peer would send (an IP header of 20 bytes: flags at
        byte 33); the rest goes by the default class, unshaped. Not with a shaped peer (its root is tbf)."""
        assert self.rate_mbit is None, "behind_nat replaces the root qdisc that shapes the link"
        tc = ["ip", "netns", "exec", self.name(index), "tc"]
        _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        for band in ("1:1", "1:2"):
            _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", band,
                 "htb", "rate", "10gbit", "quantum", "60000")  # fmt: skip
        _run(*tc, "qdisc", "add", "dev", "eth0", "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
        _run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x12", "0x12", "at", "33",
             "flowid", "1:2")  # fmt: skip

    def close(self) -> None:
        for ns in reversed(self._made):  # a namespace takes its veth ends with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ):
        self.close()
