"""The nics setting: parsing, and which address a host offers for a given interface table."""
from __future__ import annotations

import pytest

from sparktrain.host import nics
from sparktrain import settings
from sparktrain.errors import InvalidArgumentError

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.168.7.5", "fd00::5"], "ib0": ["10.1.2.3"], "eth1": ["10.9.0.4"]}


@pytest.mark.parametrize("value, parsed", [
    ("eth1", ("eth1",)),
    (" ib0 , 10.1.0.0/16 ", ("ib0", "10.1.0.0/16")),
    (["10.1.2.0/255.255.255.0"], ("10.1.2.0/24",)),
    ({"eth1"}, ("eth1",)),
    ("10.1.2.3/16", ("10.1.0.0/16",)),  # a host address with its prefix names its subnet
    ("fd00::/64", ("fd00::/64",)),
    ("", None),
    (None, None),
])
def test_entries_parse_into_names_and_subnets(value, parsed):
    assert nics.parse("nics", value) == parsed


@pytest.mark.parametrize("value, words", [
    ("eth 1", ["'eth 1'", "interface name", "subnet"]),
    ("10.0.0.0/33", ["'10.0.0.0/33'", "10.1.0.0/16"]),
    ("averyveryverylongname", ["'averyveryverylongname'"]),
    (7, ["7"]),
    ([1, 2], ["[1, 2]"]),
])
def test_bad_entries_are_refused_naming_them(value, words):
    with pytest.raises(InvalidArgumentError) as e:
        nics.parse("nics", value)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("entries, address", [
    (["ib0"], "10.1.2.3"),
    (["10.1.0.0/16"], "10.1.2.3"),
    (["nosuch0", "eth1"], "10.9.0.4"),  # the first entry that matches, in the order given
    (["eth1", "ib0"], "10.9.0.4"),
    (["fd00::/16"], "fd00::5"),
    (["172.16.0.0/12"], None),
    (["wlan0"], None),
])
def test_a_host_offers_the_first_address_the_entries_match(entries, address):
    assert nics.address(entries, TABLE) == address


def test_the_setting_resolves_from_argument_environment_and_conf():
    conf = {"spark.sparktrain.nics": "10.1.0.0/16"}
    assert settings.resolve("nics", None, conf=conf, environ={}) == ("10.1.0.0/16",)
    assert settings.resolve("nics", None, conf=conf, environ={"SPARKTRAIN_NICS": "ib0"}) == ("ib0",)
    assert settings.resolve("nics", ["eth1"], conf=conf, environ={"SPARKTRAIN_NICS": "ib0"}) == ("eth1",)
    assert settings.resolve("nics", None, conf={}, environ={}) is None


def test_a_missing_network_is_named_with_the_hosts_interfaces():
    message = nics.no_match(("ib0",), "rank 3's host 10.0.0.7", {"eth0": ["10.0.0.7"], "lo": ["127.0.0.1"]})
    assert "nics=ib0" in message and "rank 3's host 10.0.0.7" in message
    assert "eth0 10.0.0.7, lo 127.0.0.1" in message and "SPARKTRAIN_NICS" in message


def test_this_hosts_interfaces_are_read_and_loopback_is_found():
    table = nics.interfaces()
    assert "127.0.0.1" in table.get("lo", [])
    assert nics.own_address(("lo",), "this host") == "127.0.0.1"
    assert nics.own_address(("127.0.0.0/8",), "this host") == "127.0.0.1"
    assert not any(a.startswith("fe80") for addrs in table.values() for a in addrs)
