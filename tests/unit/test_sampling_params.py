"""H12: sampling parameters that do not build, or that upstream cannot even read, become the
ValueError SGLang answers with 400, naming the fields that are not numbers; other errors pass
through as upstream raises them."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from sglang_hardened.runtime.sampling_params import misfits, normalize_request, refuse_params_that_do_not_build


@dataclasses.dataclass(kw_only=True)
class Params:  # the shape of 0.5.19's SamplingParams: typed fields, a __post_init__ that compares
    max_new_tokens: Optional[int] = 128
    n: int = 1
    stop: Optional[str | list[str]] = None
    temperature: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        if 0 <= self.temperature < 1e-6:
            self.temperature = 1.0


def build(**params: object) -> Params:
    with refuse_params_that_do_not_build(Params, params):
        return Params(**params)


def test_a_string_where_a_number_goes_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^sglang-hardened H12: sampling_params do not build "
                                         r"\(not a number: temperature='hot'\)$") as e:
        build(temperature="hot", stop="x")
    assert isinstance(e.value.__cause__, TypeError)


def test_an_unknown_field_is_refused_with_upstream_s_words():
    with pytest.raises(ValueError, match=r"H12: .*unexpected keyword argument 'temprature'"):
        build(temprature=0.5)


def test_what_builds_is_built_and_upstream_s_own_errors_pass_as_they_are():
    assert build(temperature=0, max_new_tokens=None, ignore_eos=True).temperature == 1.0
    with pytest.raises(KeyError):
        with refuse_params_that_do_not_build(Params, {}):
            raise KeyError("not a build error")


def test_a_long_value_is_cut_in_the_message():
    assert misfits(Params, {"max_new_tokens": "9" * 100, "stop": 5}) == ["max_new_tokens='" + "9" * 39]


def test_none_is_named_only_where_the_field_is_not_optional_and_a_bool_field_never():
    assert misfits(Params, {"n": None, "max_new_tokens": None, "ignore_eos": "yes"}) == ["n=None"]
    assert misfits(Params, [{"n": "2"}, {"temperature": [1]}]) == ["n='2'", "temperature=[1]"]  # a batch


@dataclasses.dataclass
class Request:  # the shape of GenerateReqInput: normalize reads n and compares it, as upstream does
    sampling_params: object

    def normalize_batch_and_arguments(self):
        if self.sampling_params is not None:
            first = self.sampling_params if isinstance(self.sampling_params, dict) else self.sampling_params[0]
            if first.get("n", 1) > 1:
                self.sampling_params = [first] * first["n"]


@pytest.mark.parametrize("params, says", [
    ({"n": None}, r"not a number: n=None"),  # 0.5.22's schema gate lets null through
    ({"n": "2"}, r"not a number: n='2'"),
    ("x", r"sampling_params is a str, not an object"),
])
def test_a_request_upstream_cannot_read_is_refused_naming_the_cause(params, says):
    with pytest.raises(ValueError, match=rf"^sglang-hardened H12: sampling_params do not build \({says}"):
        normalize_request(Request(params), Params)


def test_a_request_upstream_reads_is_read_as_upstream_reads_it():
    request = Request({"n": 2})
    normalize_request(request, Params)
    assert request.sampling_params == [{"n": 2}, {"n": 2}]
