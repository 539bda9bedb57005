"""`deploy check`'s reading of smg's credential flags, in every form smg's parser takes them.

The rendered recipe's own form is judged in tests/integration/test_kubernetes_recipe.py (it needs
kubectl); here, the forms an operator's overlay may write instead: `--flag=value`, several
control-plane keys after one flag (nargs '*'), and a flag repeated.
"""

from __future__ import annotations

from sglang_hardened.common.knobs import BOOTSTRAP_TOKEN
from sglang_hardened.operations.deploy_wiring import SMG_KEYS_FLAG, judge_wiring

SECRET = {"secretKeyRef": {"name": "s", "key": "k"}}


def _docs(smg_args: list[str], smg_env: list[str]) -> list[dict]:
    """A rendered recipe reduced to what the judge reads: two servers with the token, smg with `smg_args`."""
    def template(component: str, container: dict) -> dict:
        return {"metadata": {"labels": {"app.kubernetes.io/component": component}}, "spec": {"containers": [container]}}

    server = {"name": "server", "env": [{"name": BOOTSTRAP_TOKEN.name, "valueFrom": SECRET}]}
    smg = {"name": "gateway", "command": ["smg", "launch", *smg_args],
           "env": [{"name": name, "valueFrom": SECRET} for name in smg_env]}
    return [{"kind": "Deployment", "spec": {"template": template("gateway", smg)}},
            {"kind": "RoleBasedGroup", "spec": {"roles": [{"standalonePattern": {"template": template(role, server)}}
                                                          for role in ("prefill", "decode")]}}]


def _findings(smg_args: list[str], smg_env: tuple[str, ...] = ("A", "B")) -> list[str]:
    return [f.what for f in judge_wiring(_docs(smg_args, list(smg_env)), "site")]


def test_every_form_of_the_flags_is_read_and_each_credential_judged():
    assert _findings([f"{SMG_KEYS_FLAG}=a:a:admin:$(A)", "--port", "8000"]) == []
    assert _findings([SMG_KEYS_FLAG, "a:a:admin:$(A)", "b:b:admin:$(B)", "--api-key", "$(A)"]) == []
    # the second of two keys after one flag, a literal; the flag's end is the next flag
    assert _findings([SMG_KEYS_FLAG, "a:a:admin:$(A)", "b:b:admin:s3cret", "--port", "8000"]) == [
        f"smg's {SMG_KEYS_FLAG} credential is written into the manifest"]
    assert _findings(["--tenant-api-key", "t1:$(A)", "--tenant-api-key=t2:$(C)", SMG_KEYS_FLAG, "a:a:admin:$(B)"]) == [
        "smg's --tenant-api-key credential is not set"]
    assert _findings([SMG_KEYS_FLAG, "--port", "8000"]) == [  # the flag with no value: no key at all
        f"smg starts without {SMG_KEYS_FLAG}: whoever reaches its port removes workers (DELETE /workers/<id>) or "
        "adds its own (POST /workers)"]
