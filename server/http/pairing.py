"""Serving beyond loopback: the addresses a phone or laptop reaches the server at, and a pairing
link (`http://ADDRESS:PORT/#key=KEY`) with its QR code for the terminal. Scanning it opens the chat
page with the key filled in; the page keeps the key and drops it from the address bar. The key
travels in the URL's fragment, which browsers never send to a server.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from urllib.parse import quote

import segno

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def lan_addresses(host: str) -> list[str]:
    """The IPv4 addresses clients can use: `host` itself when it names one, else (0.0.0.0) every
    non-loopback interface's address."""
    if host not in ("0.0.0.0", "::", ""):
        return [host]
    found = (_interface_address(name) for _, name in socket.if_nameindex())
    return sorted({a for a in found if a is not None and not ipaddress.ip_address(a).is_loopback})


def pairing_url(address: str, port: int, key: str | None) -> str:
    shown = f"[{address}]" if ":" in address else address
    fragment = f"#key={quote(key, safe='')}" if key else ""
    return f"http://{shown}:{port}/{fragment}"


def pairing_banner(host: str, port: int, key: str | None) -> str:
    """What the terminal shows: each address's chat page link, and a QR code of the first."""
    addresses = lan_addresses(host)
    if not addresses:
        return f"serving on {host}:{port}, but no network interface has an IPv4 address to show"
    urls = [pairing_url(address, port, key) for address in addresses]
    lines = ["", "Open the chat page from a phone or laptop on this network:"]
    lines += [f"  {url}" for url in urls]
    lines.append("or scan (the key is in the link):" if key else "or scan:")
    qr = segno.make(urls[0], error="m")
    lines.append(_terminal_qr(qr))
    return "\n".join(lines)


def _terminal_qr(qr: segno.QRCode) -> str:
    import io

    out = io.StringIO()
    qr.terminal(out=out, compact=True)
    return out.getvalue()
