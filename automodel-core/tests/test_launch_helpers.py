"""The distributed tests' launch helpers: rendezvous ports never handed out twice, and a failed rank ends its
launch at once instead of leaving its peers waiting for the timeout; the CLI's line for a rank killed by a signal."""

import socket
import subprocess
import sys
import time

from parallel_testing import _wait_group

from automodel.testing import free_port


def test_free_port_never_repeats_and_stays_out_of_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(21_000 <= port < 22_000 for port in ports)
    with socket.socket() as sock:  # a port handed out is still bindable by the launch that gets it
        sock.bind(("127.0.0.1", ports[-1]))


def test_free_port_skips_a_port_in_use(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    taken = []
    try:
        for port in range(22_000, 23_000):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            taken.append(sock)
            if len(taken) == 990:
                break
        free = {p for p in range(22_000, 23_000)} - {s.getsockname()[1] for s in taken}
        assert free_port() in free
    finally:
        for sock in taken:
            sock.close()


def test_a_failed_rank_ends_the_launch_at_once():
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    start = time.monotonic()
    assert _wait_group([failing, waiting], time.monotonic() + 120) == [3, "killed"]
    assert time.monotonic() - start < 30


def test_a_launch_past_its_deadline_is_killed():
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert _wait_group([sleeping], time.monotonic() + 1) == ["timeout"]


def test_a_rank_killed_by_a_signal_is_named_with_it_and_sigkill_with_its_commonest_cause():
    """torchrun reports a rank ended by a signal as the negative signal number (Popen's returncode)."""
    from automodel.cli.torchrun import how_it_stopped

    assert how_it_stopped(2) == "stopped with exit status 2 (its message is above)"
    assert how_it_stopped(-15) == "was killed by signal 15 (SIGTERM)"
    killed = how_it_stopped(-9)
    assert killed.startswith("was killed by signal 9 (SIGKILL): it could print nothing")
    assert "out-of-memory killer" in killed and "shard the model over more processes" in killed
    assert how_it_stopped(-200) == "was killed by signal 200 (an unknown signal)"
