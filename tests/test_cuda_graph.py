"""The capture/replay core both CUDA graphs share (cuda_graph.py): how a failed capture is told and
which inputs a graph takes. Capture and replay themselves are checked on CUDA
(tests/test_target_graph.py, tests/test_trainer_compile.py)."""

import logging

import pytest
import torch

from dflash_mp.cuda_graph import capture_failed, describe, signature


def _raised(message: str) -> RuntimeError:
    """The error a function raising `message` gives its caller."""
    def capture():
        raise RuntimeError(message)
    with pytest.raises(RuntimeError) as info:
        capture()
    return info.value


CAPTURING = ("CUDA error: operation not permitted when stream is capturing\n"
             "CUDA kernel errors might be asynchronously reported at some other API call")


def test_a_failed_capture_is_told_in_one_line_of_at_most_200_characters():
    first = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert describe(_raised(CAPTURING)) == first
    assert describe(_raised("y" * 300 + "\n" + CAPTURING)) == "RuntimeError: " + "y" * 200
    with pytest.raises(RuntimeError) as info:
        torch.zeros(2).view(3)
    assert describe(info.value) == "RuntimeError: shape '[3]' is invalid for input of size 2"
    assert describe(_raised("")) == "RuntimeError: "  # no message: still a line, not an IndexError


def test_a_failed_capture_is_warned_with_the_setting_that_skips_it(caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_mp.cuda_graph"):
        why = capture_failed("target forward", _raised(CAPTURING), "uncaptured", "target.cuda_graph=false")
    assert why == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (f"target forward: the CUDA graph capture failed ({why}); running "
                                   "uncaptured. target.cuda_graph=false skips the capture.")


def test_a_graph_takes_only_inputs_of_its_own_shapes_dtypes_and_absent_ones():
    x, pos = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)
    key = signature([x, pos, None])
    assert key == (((1, 8), torch.long), ((1, 8), torch.long), None)
    assert signature([x.clone(), pos + 1, None]) == key  # values do not matter
    assert signature([x, pos, torch.zeros(8, 4)]) != key  # an input present where it was absent
    assert signature([x, pos.int(), None]) != key
    assert signature([x[:, :4], pos[:, :4], None]) != key
