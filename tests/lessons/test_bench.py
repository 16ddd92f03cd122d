"""The sys512 benchmark's measurement of transformers' ``generate_batch``
(``kvlab.bench.peers``)."""

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import tiny_qwen2  # noqa: E402

from kvlab.bench import peers as B  # noqa: E402
from kvlab.lessons import workloads as W  # noqa: E402

CB_LOGGER = (
    "ContinuousBatchingLogger"  # where transformers' continuous batching logs its prefix matches
)


def test_prefix_matches_are_read_from_the_debug_log_and_the_logger_is_left_as_it_was(capsys):
    log = logging.getLogger(CB_LOGGER)
    level, filters = log.level, list(log.filters)
    with B._count_prefix_matches() as found:
        log.debug("Found a prefix match of 32 tokens for request r1")
        log.debug("some other debug line")
        log.debug("Found a prefix match of 16 tokens for request r2")
    assert found == [32, 16]
    assert log.level == level and log.filters == filters
    # the collected debug lines are not printed
    assert "prefix match" not in capsys.readouterr().err


def test_generate_batch_reports_the_blocks_it_shared():
    model = tiny_qwen2()
    wl = W.sys512(256, num_requests=3, prefix_tokens=48, suffix_tokens=8, max_tokens=4)
    # one prefill per step: later ones hit
    shared = B.run_generate_batch(model, wl, True, max_batch_tokens=B._one(wl))
    isolated = B.run_generate_batch(model, wl, False, max_batch_tokens=B._one(wl))
    if "error" in shared:
        pytest.skip(shared["error"])
    assert shared["cached_tokens"] > 0 and shared["cached_tokens"] % 16 == 0
    assert isolated["cached_tokens"] == 0
