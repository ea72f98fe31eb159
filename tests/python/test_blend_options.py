"""A blend's and a pack mode's options through the Python client and the C library, without a
daemon: what Loader and Client.attach check alone (both or neither of dataset and blend, each
weight, the pack mode), what the C library refuses before it contacts a daemon (with a socket
that only listens), the C keys themselves, and the blend's history in state_dict: saved, loaded,
pickled and sent back at the next attach."""

from __future__ import annotations

import ctypes
import math
import os
import pickle
import socket as socketlib

import numpy as np
import pytest

import gpufeed
from gpufeed import _capi

torch = pytest.importorskip("torch")
import gpufeed.torch  # noqa: E402

class Sent(Exception):
    """Raised by a stand-in for Client.attach once it noted what it was sent."""


SEGMENTS = [{"start": 0, "weights": [0.5, 0.3, 0.2], "ledger": [0, 0, 0]},
            {"start": 10, "weights": [0.1, 0.6, 0.3], "ledger": [5, 3, 2]}]


@pytest.fixture
def sources(tmp_path):
    """Three sources: a directory, a glob and a .npy file (a few tokens each)."""
    (tmp_path / "web").mkdir()
    (tmp_path / "code").mkdir()
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "web" / "a.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "code" / "x.bin")
    np.save(tmp_path / "math.npy", np.arange(100, dtype=np.uint16))
    return {f"{tmp_path}/web/": 0.5, f"{tmp_path}/code/*.bin": 0.3, f"{tmp_path}/math.npy": 0.2}


@pytest.fixture
def listening(tmp_path):
    """A socket that listens and never answers: the C library's own checks run before it
    sends anything, so their errors come back without a daemon."""
    path = str(tmp_path / "listen.sock")
    s = socketlib.socket(socketlib.AF_UNIX)
    s.bind(path)
    s.listen(8)
    yield path
    s.close()


def loader(**options):
    base = dict(kind="tokens", seq_len=8, batch_size=2, device="cpu", socket="/nonexistent.sock")
    base.update(options)
    return gpufeed.torch.Loader(**base)


def test_dataset_or_blend_is_given_never_both_never_neither(sources):
    with pytest.raises(gpufeed.InvalidArgument, match=r"^dataset and blend given together: a blend "
                       r"names its sources itself \(blend=\{'/data/web/': 0.7, \.\.\.\}\); give one$"):
        loader(dataset="/data/train.bin", blend=sources)
    with pytest.raises(gpufeed.InvalidArgument, match=r"^dataset: required \(a path, a list of shard "
                       r"files or a mapping of \.npy arrays\), or blend=\{path: weight, \.\.\.\} for "
                       r"a weighted blend of token sources$"):
        loader()
    with pytest.raises(gpufeed.InvalidArgument, match="^dataset and blend given together"):
        gpufeed.Client("/nonexistent.sock").attach("/data/train.bin", blend=sources, kind="tokens",
                                                   seq_len=8, batch_size=2)
    with pytest.raises(gpufeed.InvalidArgument, match="^dataset: required"):
        gpufeed.Client("/nonexistent.sock").attach(kind="tokens", seq_len=8, batch_size=2)


@pytest.mark.parametrize("weight,shown", [(0, "0"), (-0.5, "-0.5"), (math.nan, "nan"),
                                          (math.inf, "inf"), (True, "True"), ("0.5", "'0.5'"),
                                          (None, "None")])
def test_each_weight_is_checked_naming_its_source(weight, shown):
    blend = {"/data/web/": 0.7, "/data/code/*.bin": weight}
    with pytest.raises(gpufeed.InvalidArgument) as e:
        loader(blend=blend)
    assert e.value.message == (f"blend[1] '/data/code/*.bin': weight must be > 0 and finite, "
                               f"got {shown}")


def test_a_blend_is_of_token_sources_named_by_paths():
    with pytest.raises(gpufeed.InvalidArgument) as e:
        loader(blend={"/data/x.npy": 1.0}, kind="records")
    assert e.value.message == "blend: a blend of token sources is for kind tokens, not records"
    with pytest.raises(gpufeed.InvalidArgument, match=r"^blend: want a mapping of sources to "
                       r"weights, .* got str$"):
        loader(blend="/data/web/")
    with pytest.raises(gpufeed.InvalidArgument, match="^blend: no sources$"):
        loader(blend={})
    with pytest.raises(gpufeed.InvalidArgument, match=r"^blend\[0\]: a source is a path, got 3$"):
        loader(blend={3: 1.0})


def test_relative_sources_are_made_absolute_keeping_a_directorys_slash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lo = loader(blend={"web/": 2, "code/*.bin": 1, "/abs/math.npy": 1})
    assert lo._options["blend"] == [(f"{tmp_path}/web/", 2.0), (f"{tmp_path}/code/*.bin", 1.0),
                                    ("/abs/math.npy", 1.0)]
    # A list of pairs is a blend too, in its order.
    lo = loader(blend=[("/b", 1), ("/a", 3)])
    assert lo._options["blend"] == [("/b", 1.0), ("/a", 3.0)]


def test_the_pack_mode_is_one_of_three():
    with pytest.raises(gpufeed.InvalidArgument) as e:
        loader(dataset="/data/train.bin", pack="greedy")
    assert e.value.message == "pack: want none, concat or best_fit, got 'greedy'"
    for pack in (None, "none", "concat", "best_fit"):
        assert loader(dataset="/data/train.bin", pack=pack)._options["pack"] == pack


def test_the_c_library_refuses_before_contacting_a_daemon(sources, listening, tmp_path):
    client = gpufeed.Client(listening)
    common = dict(kind="tokens", seq_len=8, batch_size=2, job="blend-options")
    missing = f"{tmp_path}/nope/*.bin"
    with pytest.raises(gpufeed.NotFound) as e:
        client.attach(blend={**sources, missing: 0.1}, **common)
    assert e.value.message == (f"blend[3] '{missing}': listing {tmp_path}/nope: No such file or "
                               "directory")
    with pytest.raises(gpufeed.InvalidArgument) as e:
        client.attach(blend={f"{tmp_path}/code/*.txt": 1}, **common)
    assert e.value.message == f"blend[0] '{tmp_path}/code/*.txt': no files match"
    with pytest.raises(gpufeed.InvalidArgument) as e:
        client.attach("/data/train.bin", eos_id=2, **common)
    assert e.value.message == ("eos_id: ends the documents packing packs; with pack none there "
                               "is no packing (set pack concat or best_fit)")
    with pytest.raises(gpufeed.InvalidArgument) as e:
        client.attach("/data/train.bin", pack="concat", pack_lookahead=16, **common)
    assert e.value.message == "pack_lookahead: the documents best_fit packs together; pack is concat"
    with pytest.raises(gpufeed.InvalidArgument) as e:
        client.attach(blend=sources, blend_history=[{"start": 0, "weights": [1, 1, 1],
                                                     "ledger": [0, -1, 0]}], **common)
    assert e.value.message == "blend_history[0].ledger[1]: want an integer >= 0, got -1"
    with pytest.raises(gpufeed.InvalidArgument) as e:
        client.attach(blend=sources, blend_history=[{"start": 0, "weights": [1]}], **common)
    assert e.value.message == "blend_history[0]: no 'ledger'"


def test_the_c_keys_of_a_blend_and_a_pack_mode():
    lib = _capi.lib()
    options = ctypes.c_void_p()
    assert lib.gpufeed_options_create(ctypes.byref(options)) == 0
    try:
        def error(status):
            assert status == 3  # INVALID_ARGUMENT
            return _capi.last_error(lib)

        for mode in (b"none", b"concat", b"best_fit"):
            assert lib.gpufeed_options_set_string(options, b"pack", mode) == 0
        assert error(lib.gpufeed_options_set_string(options, b"pack", b"fit")) == \
            "pack: want none, concat or best_fit, got 'fit'"
        assert lib.gpufeed_options_set_int(options, b"eos_id", 50256) == 0
        assert lib.gpufeed_options_set_int(options, b"pack_lookahead", 64) == 0
        assert lib.gpufeed_options_add_blend_source(options, b"/data/web/", 0.7) == 0
        assert error(lib.gpufeed_options_add_blend_source(options, b"/data/code/*.bin", -1.0)) == \
            "blend[1] '/data/code/*.bin': weight must be > 0 and finite, got -1"
        assert error(lib.gpufeed_options_add_blend_source(options, b"/data/m.npy", math.nan)) == \
            "blend[1] '/data/m.npy': weight must be > 0 and finite, got nan"
        assert lib.gpufeed_options_set_string(
            options, b"blend_history_json",
            b'[{"start": 0, "weights": [1], "ledger": [0]}]') == 0
        assert error(lib.gpufeed_options_set_string(options, b"blend_history_json", b"{")) \
            .startswith("blend_history: not JSON: ")
        assert error(lib.gpufeed_options_set_string(
            options, b"blend_history_json", b'[{"start": 1.5, "weights": [1], "ledger": [0]}]')) \
            == "blend_history[0].start: want an integer >= 0, got 1.5"
    finally:
        lib.gpufeed_options_destroy(options)


def test_state_dict_keeps_the_blend_history_and_the_next_attach_sends_it(sources):
    lo = loader(blend=sources)
    state = {"epoch": 1, "step": 3, "samples": 24, "world_size": 1, "batch_size": 2, "seed": 0,
             "fingerprint": "fp", "blend": SEGMENTS}
    lo.load_state_dict(state)
    # A loaded fingerprint: no attach to answer state_dict.
    assert lo.state_dict() == state
    assert lo.state_dict()["blend"] is not SEGMENTS  # a copy: changing it changes no loader
    # Pickled (spawn, torch.save) with its position and history.
    again = pickle.loads(pickle.dumps(lo))
    assert again.state_dict() == state
    # The attach of the next iter() sends the history back with the position.
    sent = {}

    def attach(dataset, **options):
        sent.update(options, dataset=dataset)
        raise Sent()

    again._client.attach = attach
    with pytest.raises(Sent):
        next(iter(again))
    assert sent["dataset"] is None
    assert sent["blend"] == [(name, float(w)) for name, w in sources.items()]
    assert sent["blend_history"] == SEGMENTS
    assert sent["start"] == (1, 3) and sent["start"].samples == 24
    assert sent["start_fingerprint"] == "fp"


def test_a_state_without_blend_history_starts_the_blend_anew(sources):
    lo = loader(blend=sources)
    lo.load_state_dict({"epoch": 0, "step": 1, "fingerprint": "fp", "blend": SEGMENTS})
    lo.load_state_dict({"epoch": 0, "step": 2, "fingerprint": "fp"})
    assert lo.state_dict()["blend"] == []
    sent = {}

    def attach(dataset, **options):
        sent.update(options)
        raise Sent()

    lo._client.attach = attach
    with pytest.raises(Sent):
        next(iter(lo))
    assert sent["blend_history"] is None


def test_a_malformed_blend_history_in_a_state_is_refused_naming_it(sources):
    lo = loader(blend=sources)
    with pytest.raises(gpufeed.InvalidArgument) as e:
        lo.load_state_dict({"epoch": 0, "step": 1, "fingerprint": "fp",
                            "blend": [{"start": 0, "weights": [1, 1, 1]}]})
    assert e.value.message == "state_dict: blend[0]: no 'ledger'"
    with pytest.raises(gpufeed.InvalidArgument, match=r"^state_dict: blend: want a list"):
        lo.load_state_dict({"epoch": 0, "step": 1, "fingerprint": "fp", "blend": 3})


def test_a_loader_without_a_blend_saves_no_blend_key():
    lo = loader(dataset="/data/train.bin")
    lo.load_state_dict({"epoch": 0, "step": 1, "fingerprint": "fp"})
    assert "blend" not in lo.state_dict()
