"""A constructed two-layer "induction" model whose greedy output is the context's continuation.

The random tiny models (:mod:`.tiny_models`) mostly repeat their last prompt token: a backend whose
attention returns zeros passes them. This one cannot be passed without attention. Its weights are
written down, not trained, so what each part does is known:

* Tokens ``3 .. 3 + NUM_CODED - 1`` have orthogonal codes: the 32 rows of a Hadamard matrix and
  their negatives (every pair of codes is orthogonal or opposite). The residual stream holds four
  32-wide subspaces: the token's code ``E``, the previous token's code ``P``, the copied code ``O``,
  and one constant coordinate ``C`` (every embedding has it, so a projection of it is a bias).
* Layer 1, head 0, *previous token*: query and key are projections of ``C`` into the 16 fastest
  rotary pairs, the key's pairs turned by one position, so after RoPE the score
  ``sum_i cos((p - j - 1) w_i)`` peaks at ``j = p - 1`` (by :data:`PREV_MARGIN` nats over every other
  key up to :data:`MAX_POSITIONS`). Its value, the code of ``j``, goes to ``P``.
* Layer 1, head 1, *bag*: a zero query, so uniform attention over every key it may see; it adds
  :data:`BAG_WEIGHT` times the mean code of the visible context to ``P``. Its output changes
  whenever the set of visible keys does (a missing causal mask in prefill, a window off by some
  keys), though it is too small to change the greedy token: the logit comparison sees it.
* Layer 2, head 1, *induction*: query the code ``E`` of the current token, key the ``P`` of each
  position, both in the 16 slowest rotary pairs (which turn by under 0.1 rad over the whole
  context): the position after the previous occurrence of the current token scores
  :data:`MATCH_SCORE`, the rest about 0 or below. Its value, that position's code, goes to ``O``.
* The MLPs are zero; ``lm_head`` reads ``O``: the copied token's logit is about :data:`LOGIT_MARGIN`
  nats above every other.

A prompt that starts with a token used nowhere else and then cycles through a sequence of distinct
coded tokens is therefore continued by the cycle (:func:`cyclic_prompt`, :func:`continuation`).
Attention returning zeros, a causal mask or a window that hides the previous token or the match, a
stale or miscopied KV block, or a K/V written to the wrong slot changes the greedy tokens; smaller
errors (a future key visible in prefill, one key too many in a window) change the logprobs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from plinth_conformance.tiny_models import _tokenizer_json

VOCAB = 128
HIDDEN = 128
HEAD_SIZE = 128
HEADS = 2
KV_HEADS = 1
LAYERS = 2
MAX_POSITIONS = 512
ROPE_THETA = 1e5
CODE = 32  # width of a code (a Hadamard row)
#: Tokens with a code: ids ``FIRST_CODED .. FIRST_CODED + NUM_CODED - 1`` (Hadamard rows, then negatives).
FIRST_CODED = 3
NUM_CODED = 2 * CODE
#: Residual subspaces (start offsets) and the constant coordinate.
E, P, OUT, C = 0, 32, 64, 96
#: Rotary pairs: the 16 fastest carry the previous-token pattern, the 16 slowest the codes.
FAST_PAIRS = 16
SLOW_PAIRS = range(HEAD_SIZE // 2 - CODE // 2, HEAD_SIZE // 2)
#: Layer 1's score of the previous token above the best other key (nats), layer 2's score of a match,
#: the copied token's logit margin, and the bag head's weight in ``P``.
PREV_MARGIN = 25.0
MATCH_SCORE = 30.0
LOGIT_MARGIN = 32.0
BAG_WEIGHT = 0.5
#: Sliding window of the ``induction-sw`` model.
SLIDING_WINDOW = 24

#: Model name -> (architecture, extra config.json keys).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "induction": ("LlamaForCausalLM", {"model_type": "llama"}),
    "induction-sw": ("MistralForCausalLM", {"model_type": "mistral", "sliding_window": SLIDING_WINDOW}),
}


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def codes() -> torch.Tensor:
    """``[NUM_CODED, CODE]``: entries +-1, every two rows orthogonal or opposite."""
    h = _hadamard(CODE)
    return torch.cat((h, -h), 0)


def _inv_freq() -> torch.Tensor:
    return 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float64) / HEAD_SIZE)


def prev_token_margin(max_distance: int = MAX_POSITIONS) -> float:
    """``S(1) - max_{d != 1} S(d)`` for ``S(d) = sum_i cos((d - 1) w_i)`` over the fast pairs, ``d`` in
    ``0 .. max_distance``: how much better layer 1 head 0 likes the previous token, per unit score."""
    w = _inv_freq()[:FAST_PAIRS]
    d = torch.arange(max_distance + 1, dtype=torch.float64)
    s = torch.cos((d[:, None] - 1) * w[None, :]).sum(1)
    return float(s[1] - torch.cat((s[:1], s[2:])).max())


def _config(name: str) -> dict[str, Any]:
    architecture, extra = MODELS[name]
    return {
        "architectures": [architecture],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": ROPE_THETA,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **extra,
    }


def _weights() -> dict[str, torch.Tensor]:
    """The construction of the module docstring, in fp32 (RMSNorm weights 1)."""
    code = codes()
    scale = 1.0 / math.sqrt(HEAD_SIZE)
    half = HEAD_SIZE // 2
    w: dict[str, torch.Tensor] = {}
    emb = torch.zeros(VOCAB, HIDDEN)
    emb[FIRST_CODED : FIRST_CODED + NUM_CODED, E : E + CODE] = code
    emb[:, C] = math.sqrt(CODE)  # every token: residual norm^2 = 2 * CODE before layer 1
    w["model.embed_tokens.weight"] = emb
    lm = torch.zeros(VOCAB, HIDDEN)
    # final norm sees E, P, O (norm^2 CODE each) and C: rms 1, so the copied logit is CODE * gain
    lm[FIRST_CODED : FIRST_CODED + NUM_CODED, OUT : OUT + CODE] = code * (LOGIT_MARGIN / CODE)
    w["lm_head.weight"] = lm
    w["model.norm.weight"] = torch.ones(HIDDEN)
    # RMSNorm factors (1 / rms) the two layers' inputs get: residual E + C, then E + P + C
    norm1 = math.sqrt(HIDDEN / (2 * CODE))
    norm2 = math.sqrt(HIDDEN / (3 * CODE))
    const1 = math.sqrt(CODE) * norm1  # the constant coordinate after layer 1's norm
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        q = torch.zeros(HEADS * HEAD_SIZE, HIDDEN)
        k = torch.zeros(KV_HEADS * HEAD_SIZE, HIDDEN)
        v = torch.zeros(KV_HEADS * HEAD_SIZE, HIDDEN)
        o = torch.zeros(HIDDEN, HEADS * HEAD_SIZE)
        v[:CODE, E : E + CODE] = torch.eye(CODE) / norm1 if i == 0 else torch.eye(CODE) / norm2  # value = code
        if i == 0:
            # head 0: q . k = a^2 cos((p - j - 1) w_i) per fast pair, a^2 * scale * margin = PREV_MARGIN
            a = math.sqrt(PREV_MARGIN / (prev_token_margin() * scale))
            w_fast = _inv_freq()[:FAST_PAIRS].float()
            for pair in range(FAST_PAIRS):
                q[pair, C] = a / const1
                k[pair, C] = a * math.cos(float(w_fast[pair])) / const1
                k[pair + half, C] = a * math.sin(float(w_fast[pair])) / const1
            o[P : P + CODE, :CODE] = torch.eye(CODE)  # head 0 -> P
            o[P : P + CODE, HEAD_SIZE : HEAD_SIZE + CODE] = BAG_WEIGHT * torch.eye(CODE)  # head 1 (bag) -> P
        else:
            # head 1: q = b * code(E), k = b * code(P) in the slow pairs; a match scores b^2 * CODE * scale
            b = math.sqrt(MATCH_SCORE / (CODE * scale))
            dims = [d for pair in SLOW_PAIRS for d in (pair, pair + half)]
            for c, d in enumerate(sorted(dims)):
                q[HEAD_SIZE + d, E + c] = b / norm2
                k[d, P + c] = b / norm2
            o[OUT : OUT + CODE, HEAD_SIZE : HEAD_SIZE + CODE] = torch.eye(CODE)  # head 1 -> O
        w[p + "self_attn.q_proj.weight"] = q
        w[p + "self_attn.k_proj.weight"] = k
        w[p + "self_attn.v_proj.weight"] = v
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "mlp.gate_proj.weight"] = torch.zeros(64, HIDDEN)
        w[p + "mlp.up_proj.weight"] = torch.zeros(64, HIDDEN)
        w[p + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, 64)
    return w


def save_induction_model(name: str, folder: Path) -> Path:
    """Write the ``name`` model ("induction", "induction-sw") into ``folder``; returns it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = _config(name)
    save_file(_weights(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.json").write_text(_tokenizer_json(VOCAB))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def cyclic_prompt(seed: int, period: int, length: int) -> list[int]:
    """A token no cycle uses, then ``length - 1`` tokens cycling through ``period`` distinct coded
    tokens (a seeded random choice and order)."""
    if not 1 <= period < NUM_CODED or length < 2:
        raise ValueError(f"period must be in 1..{NUM_CODED - 1} and length >= 2, got {period}, {length}")
    gen = torch.Generator().manual_seed(seed)
    order = (torch.randperm(NUM_CODED, generator=gen) + FIRST_CODED).tolist()
    start, cycle = order[0], order[1 : period + 1]
    return [start] + [cycle[i % period] for i in range(length - 1)]


def continuation(prompt: list[int], period: int, count: int) -> list[int]:
    """The ``count`` tokens that continue :func:`cyclic_prompt`'s cycle of ``period``."""
    cycle = prompt[1 : period + 1]
    done = len(prompt) - 1
    return [cycle[(done + i) % period] for i in range(count)]
