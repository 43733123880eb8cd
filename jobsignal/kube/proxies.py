"""The proxy, if any, for requests to an API server: the environment as client-go reads it.

kubectl and every client-go program take the proxy of a cluster without a
``proxy-url`` from Go's `http.ProxyFromEnvironment`, and so does jobsignal,
evaluating the variables itself (httpx's own reading of them matches neither
CIDRs in NO_PROXY nor Go's precedence):

- ``HTTPS_PROXY`` for https servers, ``HTTP_PROXY`` for http ones, each
  upper case first, then lower case (an empty value counts as unset);
  ``ALL_PROXY`` is not read (Go does not either). A value without a scheme
  (``proxy:3128``) is read as ``http://proxy:3128``.
- ``NO_PROXY`` (or ``no_proxy``): comma-separated entries, each an IP
  address (``10.96.0.1``), a CIDR (``10.96.0.0/12``, IPv6 too), a domain
  (``example.com`` matches it and its subdomains, ``.example.com`` and
  ``*.example.com`` only its subdomains), any of them with a port
  (``10.0.0.1:6443``, ``[::1]:6443``, ``example.com:443``), or ``*`` (no
  proxy at all). Case does not matter; malformed entries are skipped.
- ``localhost`` and loopback addresses are never proxied.
- ``REQUEST_METHOD`` set (a CGI process) refuses ``HTTP_PROXY``: a client
  could have set it through the ``Proxy`` request header.

Only the URL's host and port matter; nothing is resolved. A socks (or any
other) proxy is refused with a message: jobsignal carries http and https
proxies only, where Go would also speak socks5.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443, "socks5": 1080}

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ProxyConfigError(ValueError):
    """A proxy variable jobsignal cannot honour (the message names it)."""


@dataclass(frozen=True)
class EnvironmentProxy:
    """The proxy the environment gives one URL: its URL and the variable it came from."""

    url: str
    variable: str


def _first_set(environ: Mapping[str, str], name: str) -> tuple[str, str]:
    """(variable, value) of NAME or name, the first one set and not empty."""
    for variable in (name, name.lower()):
        if value := environ.get(variable, ""):
            return variable, value
    return name, ""


def proxy_for(url: str, environ: Mapping[str, str]) -> EnvironmentProxy | None:
    """The proxy that `environ`'s variables give requests to `url`; None: go direct."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return None
    variable, value = _first_set(environ, f"{scheme.upper()}_PROXY")
    if not value:
        return None
    if scheme == "http" and environ.get("REQUEST_METHOD", ""):
        raise ProxyConfigError(
            f"{variable} is refused in a CGI environment (REQUEST_METHOD is set): a request"
            " could have set it"
        )
    proxy = _proxy_url(variable, value)
    host = (parts.hostname or "").strip()
    port = parts.port or _DEFAULT_PORTS[scheme]
    _, no_proxy = _first_set(environ, "NO_PROXY")
    if not NoProxy.parse(no_proxy).uses_proxy(host, port):
        return None
    return EnvironmentProxy(proxy, variable)


def _proxy_url(variable: str, value: str) -> str:
    """The proxy URL of a variable's value: `host:port` is read as http, as Go
    reads it; a scheme other than http and https is refused."""
    value = value.strip()
    scheme = urlsplit(value).scheme.lower() if "://" in value else ""
    if not scheme:
        value, scheme = f"http://{value}", "http"
    if scheme not in ("http", "https"):
        raise ProxyConfigError(
            f"{variable} names a {scheme} proxy, which jobsignal does not support"
            " (http and https proxies only)"
        )
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 (a ValueError for a port out of range)
    except ValueError:
        raise ProxyConfigError(f"{variable} has an invalid port") from None
    if not parts.hostname:
        raise ProxyConfigError(f"{variable} names no proxy host")
    return value


@dataclass(frozen=True)
class _DomainRule:
    suffix: str  # with its leading dot
    port: int | None
    # "example.com" matches the name itself as well; ".example.com" only subdomains.
    exact_too: bool

    def matches(self, host: str, port: int) -> bool:
        if host.endswith(self.suffix) or (self.exact_too and host == self.suffix[1:]):
            return self.port is None or self.port == port
        return False


@dataclass(frozen=True)
class NoProxy:
    """The entries of a NO_PROXY value, parsed once."""

    everything: bool = False
    networks: tuple[_Network, ...] = ()
    addresses: tuple[tuple[_Address, int | None], ...] = ()
    domains: tuple[_DomainRule, ...] = ()

    @classmethod
    def parse(cls, value: str) -> NoProxy:
        networks: list[_Network] = []
        addresses: list[tuple[_Address, int | None]] = []
        domains: list[_DomainRule] = []
        for raw in value.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry == "*":
                return cls(everything=True)
            if "/" in entry:
                # (Neither a CIDR nor anything else when it does not parse: skipped, as Go does.)
                with contextlib.suppress(ValueError):
                    networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            host, port = _split_port(entry)
            if port == -1 or not host:
                continue  # a port that is no number, or no host: malformed
            address = _address(host)
            if address is not None:
                addresses.append((address, port))
                continue
            if host.startswith("*."):
                host = host[1:]
            exact_too = not host.startswith(".")
            suffix = host if host.startswith(".") else f".{host}"
            domains.append(_DomainRule(_ascii(suffix), port, exact_too))
        return cls(False, tuple(networks), tuple(addresses), tuple(domains))

    def uses_proxy(self, host: str, port: int) -> bool:
        """Whether a request to `host`:`port` goes through the proxy."""
        host = _ascii(host.lower())
        address = _address(host)
        if host == "localhost" or (address is not None and address.is_loopback):
            return False
        if self.everything:
            return False
        if address is not None:
            # (An address is in no network of the other IP version.)
            if any(address in network for network in self.networks):
                return False
            if any(address == ip and wanted in (None, port) for ip, wanted in self.addresses):
                return False
        return not any(rule.matches(host, port) for rule in self.domains)


def _split_port(entry: str) -> tuple[str, int | None]:
    """(host, port) of `host`, `host:port`, `[v6]` or `[v6]:port`; port -1 when it is no number.

    A bare IPv6 address (colons, no brackets) is a host without a port.
    """
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket:
            return "", None
        if not rest:
            return host, None
        if not rest.startswith(":"):
            return "", None
        return host, _port(rest[1:])
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _port(port)
    return entry, None


def _port(text: str) -> int:
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else -1


def _address(host: str) -> _Address | None:
    """The IP address `host` spells (an IPv4-mapped IPv6 one as IPv4), else None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _ascii(name: str) -> str:
    """An internationalised domain name in its ASCII form (as Go's idna lookup gives it)."""
    if name.isascii():
        return name
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        return name
