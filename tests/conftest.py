import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch as th

from sb3_speedups.common import torch_utils

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def log_folder(tmp_path: Path) -> Path:
    """A fresh log folder."""
    return tmp_path / "logs"


@pytest.fixture
def torch_threads_restored() -> Iterator[None]:
    """
    Torch's thread count and the package's record of the count it set, both restored after the test: a model made in
    the test sets them (a CNN: every core), and a count left behind that differs from the record would pass for the
    user's choice in later tests.
    """
    threads, package_set = th.get_num_threads(), torch_utils._package_set
    yield
    th.set_num_threads(threads)
    torch_utils._package_set = package_set


@pytest.fixture
def one_torch_thread(torch_threads_restored: None) -> None:
    """The models of a test are tiny: one thread, as the package's own default, keeps them fast on a busy machine."""
    th.set_num_threads(1)


@pytest.fixture(autouse=True)
def _signal_state_is_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """
    Every test starts with the SIGINT/SIGTERM handlers and signal mask the session started with, so that the tests
    of Ctrl-C handling never depend on what ran before them in the same process. A test that leaves them changed is
    named in a warning (a leak in the code it ran), and the state is put back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    changed = [sig.name for sig in _SIGNALS if signal.getsignal(sig) is not handlers[sig]]
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) != mask:
        changed.append("signal mask")
    if changed:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        warnings.warn(f"{request.node.nodeid} left {', '.join(changed)} changed (restored)", stacklevel=1)
