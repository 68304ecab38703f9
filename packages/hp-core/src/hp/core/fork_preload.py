"""What a fork server started as a new interpreter (:func:`hp.core.fork_context.warm`) imports before it
forks a worker: SIGTERM blocked first, before torch starts any thread (see
:func:`hp.core.fork_context.become_server`), then what every worker imports
(:func:`hp.core.fork_context.import_preloaded`), then the rest of becoming the server.
"""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import os  # noqa: E402

from hp.core import fork_context  # noqa: E402

fork_context.import_preloaded()
_parent = os.environ.get(fork_context.PARENT_ENV, "")
fork_context.become_server(int(_parent) if _parent.isdigit() else None, {})
