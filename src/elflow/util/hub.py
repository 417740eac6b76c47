"""Whether the Hugging Face Hub can be asked: HF_HUB_OFFLINE, and one cheap connection test per process so that
a machine without a network fails at once."""

from __future__ import annotations

import functools
import os
import socket


# ----------------------------------------------------------------------------------------------------------
# the Hugging Face Hub
def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout: float = 3.0) -> bool:
    """One cheap connection test per process, so that a machine without a network fails at once instead of
    after the hub clients' retries (about 50 s)."""
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # the proxy decides; let the client try
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_local_only(local: bool = False) -> bool:
    """`local_files_only` for a from_pretrained call: a local folder, HF_HUB_OFFLINE, or no network."""
    return local or hub_offline() or not hub_reachable()


def hub_unavailable_reason() -> str | None:
    """Why the hub cannot be asked (None when it can), as a clause without brackets, to go inside a
    message's own."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not hub_reachable():
        return ("no network: the Hugging Face Hub cannot be reached from here; HF_HUB_OFFLINE=1 reads the local "
                "cache without this check")
    return None
