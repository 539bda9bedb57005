"""H12: sampling parameters that do not build are refused with 400 naming them, not a bare 500.

0.5.19-0.5.21 build a request's ``SamplingParams`` from the client's JSON as it came:
``{"temperature": "hot"}`` makes ``__post_init__`` compare a string with a number, and the
``TypeError`` escapes the generate route (which turns only ``ValueError`` into a 400), so
the client gets ``500 Internal Server Error`` with no cause and a load balancer counts a
healthy server as failing. 0.5.22 put a schema gate in front of the routes
(``entrypoints/api_contract.py``), which refuses such a body with 400; this is the same
answer for the bases without it, where every route first reads a request's parameters
(``normalize_batch_and_arguments``: ``{"n": "2"}`` fails there) and where it builds them.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Iterator, Mapping

from . import metrics

NUMBERS = (int, float)  # bool is an int: SGLang takes it where a number goes
SHOWN_CHARS = 40  # of a refused value, in the message


def _takes_a_number(annotation: object) -> tuple[bool, bool]:
    """(whether a field annotated so takes only numbers, whether it also takes None). A bool
    field is not one: upstream takes any value there as true or false."""
    if annotation in NUMBERS:
        return True, False
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    numbers = typing.get_origin(annotation) is typing.Union and bool(args) and all(a in NUMBERS for a in args)
    return numbers, numbers and len(args) < len(typing.get_args(annotation))


def misfits(params_class: type, params: object) -> list[str]:
    """``name=value`` for each parameter (of each request of a batch) whose field takes a
    number and whose value is none: None counts only where the field is not Optional."""
    if not isinstance(params, Mapping):
        return [misfit for one in params for misfit in misfits(params_class, one)] if isinstance(params, list) else []
    try:
        annotations = typing.get_type_hints(params_class)
    except Exception:  # an annotation that does not resolve: name none, say upstream's words
        annotations = {}
    named = []
    for name, value in params.items():
        numbers, optional = _takes_a_number(annotations.get(name))
        if numbers and not isinstance(value, NUMBERS) and not (value is None and optional):
            named.append(f"{name}={value!r:.{SHOWN_CHARS}}")
    return named


def _not_an_object(params: object) -> str | None:
    """What the parameters are when they are neither an object nor a batch's list of them."""
    if params is None or isinstance(params, Mapping):
        return None
    if isinstance(params, list) and all(isinstance(one, Mapping) for one in params):
        return None
    return f"sampling_params is a {type(params).__name__}, not an object (or a batch's list of objects)"


@contextlib.contextmanager
def refuse_params_that_do_not_build(params_class: type, params: object) -> Iterator[None]:
    """Around upstream's reading, building, normalizing and verifying of a request's sampling
    parameters: a ``TypeError`` (or, on a body of the wrong shape, ``AttributeError``) there
    becomes the ``ValueError`` SGLang answers with 400, naming the fields."""
    try:
        yield
    except (TypeError, AttributeError) as e:
        named = misfits(params_class, params)
        which = f"not a number: {', '.join(named)}" if named else _not_an_object(params) or str(e)
        metrics.refused("H12", "api", "sampling_params")
        raise ValueError(f"sglang-hardened H12: sampling_params do not build ({which})") from e


def normalize_request(obj: object, params_class: type) -> None:
    """Upstream's ``obj.normalize_batch_and_arguments()``, where ``{"n": "2"}`` or
    ``"sampling_params": "x"`` first fails, refused as a build is."""
    with refuse_params_that_do_not_build(params_class, getattr(obj, "sampling_params", None)):
        obj.normalize_batch_and_arguments()
