"""Transparent re-attach seen from gpufeed.torch.Loader, host delivery: gpufeedd is
SIGKILLed mid-epoch and started again on the same socket; the loader pauses, then yields the
very batches, ids and bytes a fault-free run yields, none twice, none lost."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402
from conftest import Daemon  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:gpufeed. torch .* has no uint")


def test_loader_goes_on_across_a_daemon_restart(tmp_path, datasets):
    batch, seed = 4, 5
    n, steps = 203, reference.steps_per_epoch(203, 4, 1, True)  # 50 a epoch
    expected = [reference.expected_epoch(n, seed, e, 1, batch, True)[0] for e in (0, 1)]
    daemon = Daemon(tmp_path)
    loader = gpufeed.torch.Loader(datasets.tokens_u16, socket=daemon.socket, device="cpu",
                                  timeout=30, kind="tokens", seq_len=datasets.seq_len,
                                  token_dtype="uint16", batch_size=batch, seed=seed,
                                  ring_slots=4, job="reattach")
    got = []
    try:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for b in loader:
                got.append((b.epoch, b.step, b.ids.tolist(), b["tokens"].clone()))
                if epoch == 0 and b.step == 20:
                    daemon = daemon.kill_and_restart()
    finally:
        loader.close()
        daemon.stop()
    want = [(e, s, ids) for e in (0, 1) for s, (ids, _) in enumerate(expected[e])]
    assert [g[:3] for g in got] == want
    for e, s, ids, tokens in got:
        rows = datasets.token_rows("uint16", ids).astype(np.int64)
        assert np.array_equal(tokens.numpy().astype(np.int64), rows), (e, s)


def test_a_stopped_daemon_raises_unavailable_within_the_bound(tmp_path, datasets):
    """SIGSTOP: the socket stays open and nothing answers. With no timeout on next(), the
    keepalive pings (1 s) find it and the re-attach gives up after reconnect_timeout (2 s):
    Unavailable naming the socket, in about 2 x 1 + 2 s, never a hang."""
    daemon = Daemon(tmp_path)
    loader = gpufeed.torch.Loader(datasets.tokens_u16, socket=daemon.socket, device="cpu",
                                  kind="tokens", seq_len=datasets.seq_len, token_dtype="uint16",
                                  batch_size=4, ring_slots=2, job="stopped",
                                  reconnect_timeout=2, keepalive=1)
    it = iter(loader)
    next(it)
    daemon.process.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(gpufeed.Unavailable) as raised:
            for _ in it:  # the ring's batches, then the wait
                pass
        took = time.monotonic() - start
    finally:
        daemon.process.send_signal(signal.SIGCONT)
        loader.close()
        daemon.stop()
    assert f"gpufeedd at {daemon.socket} did not come back within 2 s" in str(raised.value)
    assert 2 <= took <= 10, took
