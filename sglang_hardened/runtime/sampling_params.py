"""H12: sampling parameters that do not build are refused with 400 naming them, not a bare 500.

0.5.19-0.5.21 build a request's ``SamplingParams`` from the client's JSON as it came:
``{"temperature": "hot"}`` makes ``__post_init__`` compare a string with a number, and the
``TypeError`` escapes the generate route (which turns only ``ValueError`` into a 400), so
the client gets ``500 Internal Server Error`` with no cause and a load balancer counts a
healthy server as failing. 0.5.22 put a schema gate in front of the routes
(``entrypoints/api_contract.py``), which refuses such a body with 400; this is the same
answer for the bases without it, at the one place every route builds the parameters.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterator, Mapping

NUMBERS = (int, float)  # bool is an int: SGLang takes it where a number goes
SHOWN_CHARS = 40  # of a refused value, in the message


def _takes_a_number(annotation: object) -> bool:
    """Whether a field annotated so takes only numbers (and None where Optional)."""
    if annotation in NUMBERS or annotation is bool:
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) is typing.Union and bool(args) and all(a in NUMBERS or a is bool
                                                                               for a in args)


def misfits(params_class: type, params: Mapping[str, object]) -> list[str]:
    """``name=value`` for each parameter whose field takes a number and whose value is none."""
    try:
        annotations = typing.get_type_hints(params_class)
    except Exception:  # an annotation that does not resolve: name none, say upstream's words
        annotations = {}
    return [f"{name}={value!r:.{SHOWN_CHARS}}" for name, value in params.items()
            if _takes_a_number(annotations.get(name)) and value is not None and not isinstance(value, NUMBERS)]


@contextlib.contextmanager
def refuse_params_that_do_not_build(params_class: type, params: Mapping[str, object]) -> Iterator[None]:
    """Around upstream's build, normalize and verify of a request's sampling parameters: a
    ``TypeError`` there becomes the ``ValueError`` SGLang answers with 400, naming the fields."""
    try:
        yield
    except TypeError as e:
        named = misfits(params_class, params)
        which = f"not a number: {', '.join(named)}" if named else str(e)
        raise ValueError(f"sglang-hardened H12: sampling_params do not build ({which})") from e
