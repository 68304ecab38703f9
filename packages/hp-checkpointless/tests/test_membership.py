"""The worker's watch threads (heartbeat and generation watch), against a real TCPStore client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from hp.checkpointless.membership import Watch


def test_the_heartbeat_goes_on_while_the_store_does_not_answer(tmp_path):
    # a listener that never accepts: the kernel completes the handshake, nothing ever answers
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    heartbeat = tmp_path / "beat"
    seen = []
    watch = Watch(lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3)),
                  str(heartbeat), seen.append, beat_every_s=0.05).start()
    try:
        first = os.stat(heartbeat).st_mtime_ns
        time.sleep(1.0)
        assert os.stat(heartbeat).st_mtime_ns > first  # beaten by now, although the store read blocks
        assert seen == []  # and no generation was ever read
    finally:
        watch.stop()
        silent.close()
    assert not heartbeat.exists()  # a process that left the step loop is no longer watched for hangs


def test_membership_reads_the_protocol_without_the_controller():
    code = "import hp.checkpointless.membership, sys; assert 'hp.core.controller' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
