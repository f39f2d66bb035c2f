"""Which network ranks use: the ``nics`` setting, as Horovod's ``nics``.

Hosts with several networks (a management network and a faster data network, say) carry Spark's
own traffic on the address Spark knows them by. ``nics`` names where sparktrain's traffic goes
instead: the driver's channel and the ranks' ring. Each entry is an interface name (``eth1``) or
a subnet (``10.1.0.0/16``); a host's address for sparktrain is the first address, in the order
of the entries, of an interface so named or inside such a subnet. Pure: the interface table is
psutil's, or one given.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any, Iterable, Mapping, Sequence

from ..errors import InvalidArgumentError

#: Linux interface names: up to 15 characters, no slash or space.
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def parse(name: str, value: Any) -> tuple[str, ...] | None:
    """``"eth1,10.1.0.0/16"`` or an iterable of such entries, as a tuple; None for none.

    >>> parse("nics", "eth1, 10.1.0.0/16")
    ('eth1', '10.1.0.0/16')
    """
    if value is None:
        return None
    entries = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    if entries is None or not all(isinstance(e, str) for e in entries):
        raise InvalidArgumentError(f"{name} must be interface names or subnets, such as 'eth1' or "
                                   f"'eth1,10.1.0.0/16', got {value!r}")
    out = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        if "/" in entry:
            try:
                out.append(str(ipaddress.ip_network(entry, strict=False)))
            except ValueError:
                raise InvalidArgumentError(f"{name}: {entry!r} is not a subnet; write one as 10.1.0.0/16") from None
        elif _NAME.match(entry):
            out.append(entry)
        else:
            raise InvalidArgumentError(f"{name}: {entry!r} is neither an interface name (such as eth1) nor a "
                                       "subnet (such as 10.1.0.0/16)")
    return tuple(out) or None


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 and IPv6 addresses (not link-local ones), IPv4 first."""
    import psutil

    table: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address for a in addrs if a.family == socket.AF_INET6 and "%" not in a.address
              and not ipaddress.ip_address(a.address).is_link_local]  # link-local needs a scope to dial
        if v4 or v6:
            table[name] = v4 + v6
    return table


def address(nics: Sequence[str], table: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """This host's address for sparktrain's traffic: the first match of the first entry that matches.

    >>> address(["10.1.0.0/16"], {"eth0": ["192.168.0.5"], "eth1": ["10.1.2.3"]})
    '10.1.2.3'
    >>> address(["eth0"], {"eth0": ["192.168.0.5"], "eth1": ["10.1.2.3"]})
    '192.168.0.5'
    """
    table = interfaces() if table is None else table
    for entry in nics:
        if "/" in entry:
            net = ipaddress.ip_network(entry, strict=False)
            for addrs in table.values():
                for a in addrs:
                    ip = ipaddress.ip_address(a)
                    if ip.version == net.version and ip in net:
                        return a
        elif table.get(entry):
            return table[entry][0]
    return None


def own_address(nics: Sequence[str], where: str) -> str:
    """This host's address on the network ``nics`` names; the error names ``where`` and its interfaces."""
    table = interfaces()
    found = address(nics, table)
    if found is None:
        raise InvalidArgumentError(no_match(nics, where, table))
    return found


def describe(table: Mapping[str, Sequence[str]]) -> str:
    """``eth0 192.168.0.5, eth1 10.1.2.3``: a host's interfaces, for an error."""
    return ", ".join(f"{name} {' '.join(addrs)}" for name, addrs in sorted(table.items())) or "none"


def no_match(nics: Sequence[str], where: str, table: Mapping[str, Sequence[str]]) -> str:
    """The error when ``where`` has no address that ``nics`` names."""
    return (f"nics={','.join(nics)} names no interface or address of {where}, whose interfaces are: "
            f"{describe(table)}. Fix: name an interface or subnet that the driver and every executor host have "
            "(SPARKTRAIN_NICS, spark.sparktrain.nics or run(nics=...)), or leave nics unset to use the addresses "
            "Spark knows the hosts by")
