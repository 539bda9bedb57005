"""Tiny random-weight models and a byte-level BPE tokenizer, generated locally.

There is no model hub here, and the harness only needs a model whose greedy
output is a deterministic function of the KV it reads; a seeded random model
is exactly that and costs a few MB. Runs inside a sandbox environment (needs
torch, transformers, tokenizers): ``python -m sglang_hardened.sandbox.model DIR [VARIANT]``.

Variants: ``tiny`` (Llama, what every test runs), ``deep`` (Llama, many thin
layers: transfers of many entries), ``qwen3`` (the tiny sizes as Qwen3, for DP
attention: upstream's Llama is not written for it: its embedding and attention
heads are split over the whole TP group, not the attention-TP group, so an idle
DP rank skips a collective the busy one runs and prefill stops; Qwen3's are
split over attention TP, as DP attention needs), ``deepseek`` (DeepSeek V3's layout: MLA, one
latent KV "head" of ``kv_lora_rank + qk_rope_head_dim`` per token in upstream's MLA KV pool, and a
small MoE after one dense layer; upstream 0.5.23 runs it on CPU with no stand-in).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .env import SandboxEnv

SEED = 1234
VOCAB_SIZE = 512
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    vocab_size=VOCAB_SIZE,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
# Deep and narrow: one transfer of any prompt has 2 x 1600 entries (K and V per layer per run of
# pages), more than one Mooncake TCP call accepts (~2,050), at about the tiny model's cost per token.
DEEP = dict(num_hidden_layers=1600, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1)
# MLA with a 48-float latent per token, 4 routed experts (2 per token) and a shared one. What upstream
# reads beyond HF's config, as DeepSeek V3's own config.json carries it: `moe_layer_freq`
# (deepseek_v2.py's `_is_layer_sparse`), and YaRN rope scaling, the only rope upstream's CPU path
# builds for DeepSeek (rotary_embedding/factory.py `get_rope_cpu`), here at factor 1.
DEEPSEEK = dict(num_key_value_heads=CONFIG["num_attention_heads"], kv_lora_rank=32, q_lora_rank=64,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, moe_layer_freq=1,
                topk_method="noaux_tc", scoring_func="sigmoid",
                rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                              "original_max_position_embeddings": CONFIG["max_position_embeddings"],
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
# variant: (architecture, its sizes over CONFIG); Qwen3 sets its head size apart from the hidden size
VARIANTS = {"tiny": ("llama", {}), "deep": ("llama", DEEP),
            "qwen3": ("qwen3", {"head_dim": CONFIG["hidden_size"] // CONFIG["num_attention_heads"]}),
            "deepseek": ("deepseek_v3", DEEPSEEK)}
ARCHITECTURES = {"llama": "Llama", "qwen3": "Qwen3", "deepseek_v3": "DeepseekV3"}  # transformers' class prefix
SPECIAL = ["<unk>", "<s>", "</s>"]


def default_variant(dp: int) -> str:
    """The variant a cluster runs unless told: upstream's Llama cannot run DP attention (it
    reduces its embedding and splits its heads over the whole TP group), its Qwen3 can."""
    return "qwen3" if dp > 1 else "tiny"


def _corpus() -> list[str]:
    """A fixed, seeded word salad so BPE merges are the same on every machine."""
    import random

    rng = random.Random(SEED)
    words = ["tenant", "secret", "alpha", "bravo", "page", "cache", "token", "prefill",
             "decode", "the", "of", "and", "to", "in", "key", "value", "0123456789"]
    return [" ".join(rng.choice(words) for _ in range(64)) for _ in range(200)]


def build(out: Path, variant: str = "tiny") -> None:
    """Write config, weights and tokenizer of ``variant`` into ``out`` (overwrites)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=CONFIG["max_position_embeddings"],
    ).save_pretrained(out)

    torch.manual_seed(SEED)
    architecture, sizes = VARIANTS[variant]
    config = {**CONFIG, **sizes}
    name = ARCHITECTURES[architecture]
    model_class = getattr(transformers, f"{name}ForCausalLM")
    model = model_class(getattr(transformers, f"{name}Config")(**config)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "sandbox-model.json").write_text(json.dumps({"seed": SEED, **config}, sort_keys=True))


def ensure_model(env: SandboxEnv, variant: str = "tiny") -> Path:
    """The cached model dir of ``variant`` for ``env``, generated once per (this file, base pins)."""
    from ..common.paths import cache_dir
    from .env import PINS, SandboxError

    key = hashlib.sha256(Path(__file__).read_bytes() + (PINS / f"{env.base}.txt").read_bytes()).hexdigest()[:16]
    architecture = VARIANTS[variant][0]
    prefix = f"tiny-{architecture}" if variant in ("tiny", architecture) else f"{variant}-{architecture}"
    dest = cache_dir() / "models" / f"{prefix}-{env.base}-{key}"
    if (dest / "sandbox-model.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    run_env = env.environ()
    run_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), run_env["PYTHONPATH"]])
    r = subprocess.run([str(env.python), "-m", "sglang_hardened.sandbox.model", str(tmp), variant],
                       env=run_env, capture_output=True, text=True, cwd=dest.parent)  # not the caller's cwd: it may shadow
    if r.returncode:
        raise SandboxError(f"model generation failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    build(Path(sys.argv[1]), *sys.argv[2:])
