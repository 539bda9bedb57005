"""Start SGLang with the hardening policy applied, saying what was set and what was overridden."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib import metadata

from packaging.version import Version

from ..common.errors import HardenedError
from ..runtime.policy import PD_MODES, knobs_for


@dataclass(frozen=True)
class Decision:
    """One knob's outcome, for the log: set by policy, kept from the user, or skipped."""

    id: str
    name: str
    value: str
    outcome: str


@dataclass(frozen=True)
class Plan:
    env: dict[str, str]
    argv: list[str]
    decisions: list[Decision]


def installed_base() -> str:
    """The upstream release of the installed sglang (the public part of its version)."""
    try:
        return Version(metadata.version("sglang")).public
    except metadata.PackageNotFoundError:
        raise HardenedError("sglang is not installed in this environment") from None


def _flag_given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _pd_mode(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--disaggregation-mode" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--disaggregation-mode="):
            return arg.split("=", 1)[1]
    return None


def plan(base: str, args: list[str], environ: dict[str, str]) -> Plan:
    """Apply the policy for `base` to the user's args and environment (a user value wins)."""
    env = dict(environ)
    argv = list(args)
    in_pd = _pd_mode(args) in PD_MODES
    decisions = []
    for knob in knobs_for(base):
        if knob.env:
            if knob.env in environ:
                decisions.append(Decision(knob.id, knob.env, environ[knob.env],
                                          f"user override (policy: {knob.value})"))
            else:
                env[knob.env] = knob.value
                decisions.append(Decision(knob.id, knob.env, knob.value, "set by policy"))
        elif knob.pd_only and not in_pd:
            decisions.append(Decision(knob.id, knob.flag, "-", "not a PD server: skipped"))
        elif _flag_given(args, knob.flag):
            decisions.append(Decision(knob.id, knob.flag, "given", "user's own flag"))
        else:
            argv.append(knob.flag)
            decisions.append(Decision(knob.id, knob.flag, "on", "set by policy"))
    return Plan(env, argv, decisions)


def exec_sglang(launch: Plan) -> None:
    """Replace this process with SGLang's server (signals and exit codes pass straight through)."""
    command = [sys.executable, "-m", "sglang.launch_server", *launch.argv]
    os.execvpe(command[0], command, launch.env)
