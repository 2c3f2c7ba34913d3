"""Fetching a URL a client gave us without letting it reach what only we can reach (OWASP API7:2023, SSRF).

Image inputs (`"image": "https://..."`) and webhooks both make the service open a connection to an address a
tenant chose. Left alone, that tenant could read the cloud's metadata service (instance credentials at
169.254.169.254), Redis on loopback, or anything on the private network. The rules, in order:

1. The URL: only `http`/`https`, no user-info (`http://trusted@evil`), no control characters or backslashes
   (parsers disagree on them), a host. A host that is a number in any other form than dotted decimal
   (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`) is refused: resolvers turn them into addresses
   (`inet_aton`) that a string check never sees. IPv6 zone ids (`fe80::1%eth0`) are refused.
2. The address: we resolve the name ourselves (`loop.getaddrinfo`) and every address it gives must be allowed
   (one bad record refuses the URL: a round-robin answer is not a way around the rules). Refused: loopback,
   private (RFC 1918, unique-local), shared (100.64/10), link-local, multicast, reserved, unspecified,
   broadcast, documentation and benchmark ranges - whatever `ipaddress` says is not global, plus multicast,
   which it calls global. Addresses that carry an IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, 6to4
   `2002::/16`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`) are judged by the IPv4 address they carry;
   IPv4-compatible `::a.b.c.d` (deprecated) is refused. The cloud metadata endpoints are refused even when
   private targets are allowed.
3. The connection goes to the address we checked (pinned: no second lookup a short-TTL DNS answer could
   rebind), with the original `Host` header and, for https, the original name as SNI and for the certificate
   check. Proxies from the environment are ignored (`trust_env=False`): a proxy would resolve the name again.
4. Redirects are not followed by the client: each `Location` goes through 1-3 again, up to `max_redirects`
   (0: the 3xx is returned as it is, what webhooks want).
5. Time and size: a connect timeout, a total deadline over everything (resolution included), and a byte cap
   counted while the body streams (a `Content-Length` over it is refused before reading). With
   `read_body=False` (webhooks: the status is the whole answer) the body is not read at all: the connection is
   closed once the status line and headers are in, so the deadline bounds them and a large or slow body costs
   nothing and cannot fail the fetch.

`allow_private=True` (an explicit setting, for on-premise deployments whose image store is on the private
network) lets loopback, private, shared and unique-local addresses through; link-local (where the metadata
services live), multicast, reserved and unspecified stay refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import ipaddress
import re
import socket
import ssl
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance metadata and platform endpoints, refused whatever `allow_private` says. AWS/GCP/Azure/OpenStack/
# DigitalOcean/Oracle answer on 169.254.169.254 (GCP's metadata.google.internal resolves there), AWS's IPv6
# IMDS on fd00:ec2::254, ECS task credentials on 169.254.170.2, Alibaba on 100.100.100.200 (a shared-space
# address, so `allow_private` alone would let it through) and Azure's wireserver on 168.63.129.16 (a public
# address reachable only from inside Azure, so `is_global` alone would let it through).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "168.63.129.16", "fd00:ec2::254")
)

# Prefixes whose addresses embed an IPv4 address (RFC 6052 NAT64 well-known and local-use, RFC 3056 6to4).
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
# Private targets `allow_private` lets through (loopback, RFC 1918, shared address space, unique-local).
_PRIVATE_ALLOWED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "::1/128",
        "fc00::/7",
    )
)
# Special-purpose ranges that Python 3.11's `ipaddress` calls global: deprecated IPv6 site-local (fec0::/10, which
# some stacks still route internally), the IETF protocol assignments block 192.0.0.0/24 (192.0.0.8 among them)
# and the IPv6 documentation prefix 3fff::/20 (RFC 9637). Found by an audit.
_SPECIAL_PURPOSE = tuple(ipaddress.ip_network(n) for n in ("fec0::/10", "192.0.0.0/24", "3fff::/20"))
# Names are resolved on threads of their own, each lookup with a deadline: uvloop resolves on libuv's pool of 4
# threads, shared with the rest of the process, so four names whose DNS never answers held every lookup of the
# process (an audit saw another tenant's submit take 19 s).
_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="ssrf-dns")
RESOLVE_TIMEOUT_S = 5.0
# A lookup that passed its deadline still holds its thread until the system resolver gives up (glibc: 5 s x 2
# tries by default), so 32 unanswered names every 10 s held all 32 threads and other tenants' lookups failed (an
# audit, 2026-11-28). Lookups in flight are therefore capped per domain (a name's last two labels: what one
# party's DNS answers for): an attacker's unanswered zone holds at most this many of the 64 threads.
MAX_LOOKUPS_PER_DOMAIN = 8
_lookups_lock = threading.Lock()
_lookups: dict[str, int] = {}  # domain -> lookups on _RESOLVER threads (queued or running)
# A host made only of numbers (decimal, octal 0..., hex 0x...) separated by dots: an IPv4 address in some form.
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*\.?$", re.IGNORECASE)
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
# `read_body=False`: how long hanging up on an answer whose body is left unread may take (closing a socket).
_CLOSE_TIMEOUT_S = 1.0


class FetchError(Exception):
    """A URL that could not be fetched. `reason` is a short machine-readable code, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class BlockedURL(FetchError):
    """A URL refused by the rules (scheme, form of the host, or an address it resolves to)."""


@dataclass(frozen=True)
class Response:
    status_code: int
    headers: httpx.Headers
    content: bytes
    url: str  # the last URL requested (after redirects)
    address: str  # the address connected to


def address_refusal(ip: IPAddress, *, allow_private: bool) -> str | None:
    """Why this address may not be connected to (a short phrase), or None when it may."""
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "an IPv6 address with a zone id"
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            why = address_refusal(embedded, allow_private=allow_private)
            return None if why is None else f"{why} ({embedded}, carried in {ip})"
        if ip in _IPV4_COMPATIBLE and not ip.is_unspecified and not ip.is_loopback:
            return "an IPv4-compatible IPv6 address (deprecated)"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_multicast:  # `is_global` is True for most multicast ranges
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address"
    if allow_private and any(ip in net for net in _PRIVATE_ALLOWED):
        return None
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_private:  # RFC 1918, unique-local, and the special-purpose ranges ipaddress lists with them
        return "a private address"
    if ip.is_reserved:
        return "a reserved address"
    if any(ip in net for net in _SPECIAL_PURPOSE):
        return "a special-purpose address"
    if not ip.is_global:
        return "an address that is not globally routable"
    return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def parse_url(url: str) -> httpx.URL:
    """The URL if its form is allowed (rule 1), else BlockedURL."""
    if not isinstance(url, str) or any(c in url for c in "\\\t\r\n\x00 ") or any(ord(c) < 32 for c in url):
        raise BlockedURL("invalid_url", "the URL contains whitespace, control characters or a backslash")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise BlockedURL("invalid_url", f"the URL does not parse: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise BlockedURL(
            "scheme_not_allowed", f"only http and https URLs are fetched, not {parsed.scheme or 'none'!r}"
        )
    if parsed.userinfo:
        raise BlockedURL("userinfo_not_allowed", "URLs with a user name or password are refused")
    host = parsed.raw_host.decode("ascii")  # IDNA-encoded, what DNS, SNI and Host carry
    if not host:
        raise BlockedURL("invalid_url", "the URL has no host")
    if "%" in host:
        raise BlockedURL("invalid_url", "IPv6 zone ids and percent-encoded hosts are refused")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        # httpx parses any integer: asyncio's socket layer raised OverflowError (a 500), uvloop's connected to
        # some other port
        raise BlockedURL("invalid_url", f"the port {parsed.port} is not between 1 and 65535")
    if ":" not in host and _NUMERIC_HOST.match(host):
        try:
            canonical = ipaddress.IPv4Address(host.rstrip("."))
        except ValueError:
            canonical = None
        if canonical is None or str(canonical) != host:
            raise BlockedURL(
                "numeric_host_form",
                f"the host {host!r} is a number in a form other than dotted decimal a.b.c.d",
            )
    return parsed


async def check_url(url: str, *, allow_private: bool = False) -> list[IPAddress]:
    """The addresses `url`'s host resolves to, all allowed; BlockedURL when the URL or any address is refused."""
    parsed = parse_url(url)
    return await _resolve(parsed, allow_private=allow_private)


async def _resolve(parsed: httpx.URL, *, allow_private: bool) -> list[IPAddress]:
    host = parsed.raw_host.decode("ascii")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            infos = await asyncio.wait_for(_lookup(host, port), RESOLVE_TIMEOUT_S)
        except TimeoutError:
            raise FetchError(
                "dns_error", f"the host {host!r} did not resolve within {RESOLVE_TIMEOUT_S:g} s"
            ) from None
        except (socket.gaierror, UnicodeError) as e:
            raise FetchError("dns_error", f"the host {host!r} does not resolve: {e}") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        if not addresses:
            raise FetchError("dns_error", f"the host {host!r} resolves to no address")
    for ip in addresses:
        why = address_refusal(ip, allow_private=allow_private)
        if why is not None:
            # A name's address is not shown: it would map the deployment's internal names for the client.
            shown = f"{host!r} resolves to " if literal is None else f"{ip} is "
            raise BlockedURL(
                "address_not_allowed", f"{shown}{why}: refused (server-side request forgery rules)"
            )
    return addresses


def _lookup(host: str, port: int) -> asyncio.Future:
    """`_getaddrinfo` on a `_RESOLVER` thread, counted against the name's domain until the thread is done (not
    until the caller stops waiting). FetchError when the domain already has its MAX_LOOKUPS_PER_DOMAIN."""
    domain = ".".join(host.rstrip(".").lower().rsplit(".", 2)[-2:])
    with _lookups_lock:
        if _lookups.get(domain, 0) >= MAX_LOOKUPS_PER_DOMAIN:
            raise FetchError(
                "dns_error",
                f"{MAX_LOOKUPS_PER_DOMAIN} lookups of names under {domain!r} are still unanswered",
            )
        _lookups[domain] = _lookups.get(domain, 0) + 1

    def done(_: concurrent.futures.Future) -> None:
        with _lookups_lock:
            left = _lookups.pop(domain) - 1
            if left:
                _lookups[domain] = left

    future = _RESOLVER.submit(_getaddrinfo, host, port)
    future.add_done_callback(done)
    return asyncio.wrap_future(future)


def _getaddrinfo(host: str, port: int) -> list:
    """The system resolver's answer (on a `_RESOLVER` thread)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


async def fetch(
    url: str,
    *,
    method: Literal["GET", "POST"] = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    max_bytes: int,
    connect_timeout_s: float,
    total_timeout_s: float,
    max_redirects: int = 3,
    allow_private: bool = False,
    read_body: bool = True,
    hold: Callable[[int], bool] | None = None,
) -> Response:
    """Fetch `url` under the rules above. Raises BlockedURL (refused) or FetchError (failed: timeout, too big,
    connection refused, too many redirects); any HTTP status is a Response.

    `read_body=False`: the status and headers are the answer (`content` is empty). The body is never read, so
    neither its declared size nor its pace matters (`max_bytes` does not apply): the connection is closed as soon
    as the headers are in, and an answer whose headers came within `total_timeout_s` is returned even if closing
    the connection runs past it.

    `hold(n)`: called as each n bytes of a body arrive (decoded); False (the process holds as many as it may:
    service/api/body_limit.py) ends the fetch with FetchError "busy"."""
    answered: list[Response] = []  # read_body=False: the final answer, kept as soon as its headers are in
    try:
        async with asyncio.timeout(total_timeout_s):
            return await _fetch(
                url,
                method=method,
                body=body,
                # Bodies are decoded here, bounded (_BoundedDecoder): ask for them as they are.
                headers={"Accept-Encoding": "identity", **(headers or {})},
                max_bytes=max_bytes,
                connect_timeout_s=connect_timeout_s,
                max_redirects=max_redirects,
                allow_private=allow_private,
                answered=None if read_body else answered,
                hold=hold,
            )
    except TimeoutError:
        if answered:  # the answer was in time; only hanging up on it was not
            return answered[-1]
        raise FetchError("timeout", f"no complete answer within {total_timeout_s:g} s") from None


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """httpx's default context (certifi's CAs), built once: a client builds its own otherwise, ~70 ms of CPU on the
    event loop per fetch on this 2-core machine (loading the CA bundle), which the API's request path and its
    webhook deliverer would wait behind. A context is safe to share between connections. The first call loads the
    bundle (~0.4 s here): a long-running caller makes it in a thread at start (service/webhooks/deliverer.py)."""
    return httpx.create_ssl_context()


async def _fetch(
    url: str,
    *,
    method: str,
    body: bytes | None,
    headers: dict[str, str],
    max_bytes: int,
    connect_timeout_s: float,
    max_redirects: int,
    allow_private: bool,
    answered: list[Response] | None,
    hold: Callable[[int], bool] | None,
) -> Response:
    # No pool shared between fetches: every connection is opened to an address checked for this request.
    timeout = httpx.Timeout(None, connect=connect_timeout_s)
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=timeout, verify=ssl_context()
    ) as client:
        redirects = 0
        while True:
            parsed = parse_url(url)
            addresses = await _resolve(parsed, allow_private=allow_private)
            response = await _request_pinned(
                client,
                parsed,
                addresses,
                method,
                body,
                headers,
                max_bytes,
                answered=answered,
                final=lambda status, hdrs: not _follows(status, hdrs, max_redirects),
                hold=hold,
            )
            if not _follows(response.status_code, response.headers, max_redirects):
                return response
            location = response.headers["location"]
            if redirects >= max_redirects:
                raise FetchError("too_many_redirects", f"more than {max_redirects} redirects")
            redirects += 1
            try:
                next_url = parsed.join(location)
            except (httpx.InvalidURL, ValueError) as e:
                raise BlockedURL("invalid_url", f"a redirect to an invalid URL: {e}") from None
            if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
                method, body = "GET", None
            if (next_url.scheme, next_url.host, next_url.port) != (parsed.scheme, parsed.host, parsed.port):
                # Credentials meant for one origin are not sent to another (what browsers and httpx do).
                headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "cookie")}
            url = str(next_url)


def _follows(status: int, headers: httpx.Headers, max_redirects: int) -> bool:
    """Whether an answer is a redirect that `_fetch` goes on to (or refuses as one too many), not the answer."""
    return max_redirects > 0 and status in _REDIRECT_CODES and headers.get("location") is not None


async def _request_pinned(
    client: httpx.AsyncClient,
    parsed: httpx.URL,
    addresses: list[IPAddress],
    method: str,
    body: bytes | None,
    headers: dict[str, str],
    max_bytes: int,
    *,
    answered: list[Response] | None = None,
    final: Callable[[int, httpx.Headers], bool] | None = None,
    hold: Callable[[int], bool] | None = None,
) -> Response:
    """One request to the first of `addresses` that takes a connection. `answered` not None: the status and
    headers only (the body is not read); the answer goes into `answered` before the connection is closed when
    `final(status, headers)` says it is the one `fetch` returns."""
    host = parsed.raw_host.decode("ascii")
    default_port = 443 if parsed.scheme == "https" else 80
    host_header = host if ":" not in host else f"[{host}]"
    if parsed.port is not None and parsed.port != default_port:
        host_header += f":{parsed.port}"
    last_error: Exception | None = None
    for ip in addresses:  # each one checked; the next is tried only when a connection cannot be made
        request = client.build_request(
            method,
            parsed.copy_with(host=str(ip)),
            content=body,
            headers={**headers, "Host": host_header},
            # httpcore sends this name as SNI and checks the certificate against it, not the address.
            extensions={"sni_hostname": host} if parsed.scheme == "https" else {},
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError as e:
            last_error = e
            continue
        except httpx.TimeoutException:
            last_error = TimeoutError(f"connecting to {ip} timed out")
            continue
        except httpx.HTTPError as e:
            raise FetchError("connection_error", f"{type(e).__name__}: {e}") from None
        if answered is not None:
            answer = Response(
                status_code=response.status_code,
                headers=response.headers,
                content=b"",
                url=str(parsed),
                address=str(ip),
            )
            if final is None or final(answer.status_code, answer.headers):
                answered.append(answer)
            # Hang up without reading: an unread body closes the connection (no pool is shared). Whatever
            # happens while closing, the answer stands.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await response.aclose()
            return answer
        try:
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise FetchError(
                    "too_large", f"the answer declares {int(declared)} bytes, over the {max_bytes} cap"
                )
            decode = _BoundedDecoder(response.headers.get("content-encoding", ""), max_bytes, hold)
            async for raw in response.aiter_raw():
                decode.feed(raw)
            content = decode.finish()
        except httpx.HTTPError as e:
            raise FetchError("connection_error", f"{type(e).__name__}: {e}") from None
        finally:
            await response.aclose()
        return Response(
            status_code=response.status_code,
            headers=response.headers,
            content=content,
            url=str(parsed),
            address=str(ip),
        )
    raise FetchError("connect_failed", f"could not connect to {host!r}: {last_error}")


class _BoundedDecoder:
    """A body as it arrives, decoded from its Content-Encoding (none, or one layer of gzip or deflate) and capped
    at `max_bytes` AFTER decoding, a chunk at a time. Not httpx's own decoding: it expands each chunk in one call
    with no bound and checks nothing until it returns, and it undoes stacked encodings, so an audit's 3,477-byte
    answer (2 GiB of zeros gzipped twice) took an API to 4 GiB and stalled its event loop for 13 s (2026-11-28).
    Anything else (br, zstd, stacked layers) is refused: fetch() asks for `identity` anyway."""

    def __init__(self, content_encoding: str, max_bytes: int, hold: Callable[[int], bool] | None = None):
        layers = [e.strip().lower() for e in content_encoding.split(",") if e.strip()]
        layers = [e for e in layers if e != "identity"]
        if len(layers) > 1 or (layers and layers[0] not in ("gzip", "x-gzip", "deflate")):
            raise FetchError(
                "bad_encoding", f"the answer's Content-Encoding {content_encoding!r} is not accepted"
            )
        self._encoding = layers[0] if layers else None
        # gzip: the gzip header (wbits 16+); deflate: the zlib wrapper HTTP names, or a raw stream some servers
        # send (decided on the first bytes).
        self._inflate = (
            zlib.decompressobj(16 + zlib.MAX_WBITS) if self._encoding in ("gzip", "x-gzip") else None
        )
        self._max_bytes, self._hold = max_bytes, hold
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self._encoding is None:
            self._keep(data)
            return
        if self._inflate is None:  # deflate, first bytes: a zlib header has a multiple of 31 in its first two
            zlib_wrapped = len(data) >= 2 and (data[0] & 0x0F) == 8 and ((data[0] << 8) | data[1]) % 31 == 0
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
        try:
            while data:
                # At most one byte past the cap per call: a bomb is stopped before it expands.
                out = self._inflate.decompress(data, self._max_bytes - self._size + 1)
                self._keep(out)
                data = self._inflate.unconsumed_tail
        except zlib.error as e:
            raise FetchError("bad_encoding", f"the answer's {self._encoding} body is corrupt: {e}") from None

    def finish(self) -> bytes:
        if self._inflate is not None:
            try:
                self._keep(self._inflate.flush(self._max_bytes - self._size + 1))
            except zlib.error as e:
                raise FetchError(
                    "bad_encoding", f"the answer's {self._encoding} body is corrupt: {e}"
                ) from None
        return b"".join(self._chunks)

    def _keep(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._max_bytes:
            raise FetchError("too_large", f"the answer passed the {self._max_bytes}-byte cap while streaming")
        if self._hold is not None and data and not self._hold(len(data)):
            raise FetchError("busy", "the server holds as many fetched bytes as it may; retry shortly")
        self._chunks.append(data)
