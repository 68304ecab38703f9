"""Network cuts: when the controller reports nodes lost, this node cuts every TCP connection to their
addresses (``ss -K``, where permitted). A survivor blocked in a collective with a partitioned peer (whose
packets vanish) is released now rather than at the process group's timeout."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

from hp.core.agent.messages import say


class Cuts:
    """The lost nodes' addresses this node has cut, each once."""

    def __init__(self, own: Iterable[str]) -> None:
        self.own = set(own)  # this node's address and the controller's: never cut
        self.cut: set[str] = set()

    def cut_lost(self, addresses: list[str]) -> None:
        for address in addresses:
            if address in self.cut or address in self.own or address.startswith("127.") or address == "::1":
                continue  # never our own or a loopback address (nodes sharing one host)
            self.cut.add(address)
            if shutil.which("ss") is None:
                say(f"lost node {address}: `ss` missing, survivors wait for the process group timeout")
                continue
            done = subprocess.run(["ss", "-K", "dst", address], check=False, capture_output=True, text=True)
            say(f"lost node {address}: cut this node's connections to it"
                if done.returncode == 0 else f"lost node {address}: could not cut connections: {done.stderr.strip()}")
