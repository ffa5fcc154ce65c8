"""Where the project's servers listen: the loopback interface, unless the caller opts in to more."""

from __future__ import annotations

import ipaddress
import logging

LOOPBACK = "127.0.0.1"

logger = logging.getLogger(__name__)


class ExposureRefused(ValueError):
    """A server was asked to listen on a non-loopback address without the opt-in."""


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IPs; a host name may resolve to any interface, so it is not."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def checked_bind_address(address: str, expose: bool, server: str, opt_in: str) -> str:
    """``address``, if it is loopback or ``expose`` allows it (then with a warning naming it and the risk).

    ``server`` names what listens (for the messages); ``opt_in`` is how the caller spells ``expose``.
    """
    if is_loopback(address):
        return address
    if not expose:
        raise ExposureRefused(
            f"{server} would listen on {address}, where other machines can reach it; add {opt_in} to allow "
            f"that, or keep the default {LOOPBACK} and reach it through an SSH tunnel"
        )
    logger.warning("%s listens on %s: anyone who can reach this address can use it, without a login", server,
                   address)
    return address
