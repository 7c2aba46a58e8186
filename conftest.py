"""nbval's notebook kernels talk to pytest over Unix sockets, not TCP ports.

jupyter_client gives a kernel five TCP ports by binding port 0 and closing the socket; the kernel
binds them again about a second later. In that second the other worker's ranks open connections
(gloo's pairs, the store's clients), and each outgoing connection takes a port from the same
ephemeral range: when one takes a kernel's port, the kernel dies with "Address already in use"
before it replies, and every cell of its notebook errors ("Kernel died before replying to
kernel_info"). A Unix socket is a file in a directory of this run's own, so nothing else can take it.
"""

import os
import shutil
import tempfile
import uuid

from jupyter_client.manager import KernelManager

_sockets: str | None = None


class UnixSocketKernelManager(KernelManager):
    """A KernelManager whose channels are Unix sockets in this process's own short directory
    (a socket's path must stay under about 100 characters, so not in the runtime directory)."""

    def __init__(self, **kwargs: object) -> None:
        global _sockets
        if _sockets is None:
            _sockets = tempfile.mkdtemp(prefix="tpedu-kernels-")
        kwargs.setdefault("transport", "ipc")
        kwargs.setdefault("ip", os.path.join(_sockets, uuid.uuid4().hex[:8]))
        super().__init__(**kwargs)


def pytest_configure(config) -> None:
    if os.name == "posix":  # Windows has no Unix sockets for zmq; the course runs there in WSL
        import nbval.kernel

        nbval.kernel.KernelManager = UnixSocketKernelManager


def pytest_unconfigure(config) -> None:
    if _sockets is not None:
        shutil.rmtree(_sockets, ignore_errors=True)
