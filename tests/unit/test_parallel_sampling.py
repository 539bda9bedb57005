"""H11: n > 1 is refused on a prefill or decode server, with its cause, and served elsewhere."""

from __future__ import annotations

import enum

import pytest

from sglang_hardened.runtime.parallel_sampling import refuse_in_pd


class Mode(enum.Enum):  # SGLang's DisaggregationMode, whose values are the server flag's
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@pytest.mark.parametrize("mode", [Mode.PREFILL, Mode.DECODE, "prefill", "decode"])
def test_a_pd_server_refuses_naming_the_cause_and_the_remedy(mode):
    with pytest.raises(ValueError, match=r"H11: parallel sampling \(n > 1\).*bootstrap room.*n = 1 instead"):
        refuse_in_pd(mode)


@pytest.mark.parametrize("mode", [Mode.NULL, "null"])
def test_a_server_that_is_not_disaggregated_serves_it(mode):
    refuse_in_pd(mode)
