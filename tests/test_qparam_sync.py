"""The barrier after llm-compressor's quantization-parameter broadcast: installed where
GPTQ and QuantizationModifier call it, once, and tagged with the releases it targets
(the race it closes is reproduced by
``integration_tests/test_distributed_torchrun.py::test_stacked_gptq_gives_identical_tensors_on_both_ranks``)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

import adadsf_modifier  # noqa: F401 - installs the wrapper
from adadsf_modifier import qparam_sync


@pytest.mark.parametrize("distribution, target", sorted(qparam_sync.TARGETS.items()))
def test_workaround_targets_the_installed_release(distribution, target):
    installed = version(distribution)
    assert installed == target or installed.startswith(target + "."), (
        f"qparam_sync was written for {distribution} {target}, installed is "
        f"{installed}: check whether llm-compressor now synchronises the ranks after "
        "broadcast_qparams_and_cleanup, then update or remove the workaround"
    )


def test_both_quantizing_modifiers_call_the_synced_broadcast_once_wrapped():
    import importlib

    fns = []
    for name in qparam_sync._USERS:
        fn = importlib.import_module(name).broadcast_qparams_and_cleanup
        assert getattr(fn, qparam_sync._MARK, False), name
        fns.append(fn)
    qparam_sync.install()  # idempotent: not wrapped twice
    for name, fn in zip(qparam_sync._USERS, fns):
        assert importlib.import_module(name).broadcast_qparams_and_cleanup is fn
    assert not getattr(fns[0].__wrapped__, qparam_sync._MARK, False)


def test_the_wrapper_returns_the_original_result_without_a_process_group(monkeypatch):
    calls = []
    synced = qparam_sync._synced(lambda *a, **k: calls.append((a, k)) or "done")
    barriers = []
    monkeypatch.setattr(qparam_sync.dist, "barrier", lambda: barriers.append(1))
    assert synced(1, x=2) == "done" and calls == [((1,), {"x": 2})]
    assert barriers == []  # one process: nothing to wait for
    monkeypatch.setattr(qparam_sync.dist, "is_initialized", lambda: True)
    synced()
    assert barriers == [1]
