"""Export plinth's default GGUF model as a Hugging Face folder (fp32), for engines that need one.

The GGUF is read through plinth's own loader, so the folder holds exactly the weights plinth runs
in fp32: the Q4_1 tensors dequantized, q/k rows un-permuted back to Hugging Face's layout. Written:
``config.json`` (LlamaForCausalLM), ``generation_config.json``, ``model.safetensors`` (fp32) and the
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``special_tokens_map.json``).

    .venv/bin/python benchmarks/peers/export_hf.py [--model FILE.gguf] [--out DIR] [--dtype D] [--check]

``--check`` loads the folder with transformers and greedy-decodes a prompt, and compares the first
tokens with plinth's on the same GGUF (fp32, reference backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out" / "smollm2-135m-fp32"
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 16


def _hf_config(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """A transformers ``config.json`` for a plinth :class:`ModelConfig` of the Llama family."""
    if cfg.architecture != "LlamaForCausalLM":
        raise SystemExit(f"only LlamaForCausalLM is exported, not {cfg.architecture}")
    if cfg.rope_scaling is not None:
        raise SystemExit(f"rope scaling {cfg.rope_scaling.rope_type!r} is not exported")
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "torch_dtype": dtype,
    }


def export(model: str | None, out: Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder for ``model`` (None: plinth's default GGUF) to ``out``, its
    tensors in ``dtype`` ("bfloat16": the fp32 values rounded to nearest, as a bf16 checkpoint)."""
    import torch
    from safetensors.torch import save_file

    from plinth.model.gguf_loader import gguf_weights
    from plinth.model.gguf_reader import GGUFFile
    from plinth.model.loader import load_config, load_tokenizer, resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        raise SystemExit(f"{source} is already a Hugging Face folder")
    config = load_config(source)
    out.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in gguf_weights(GGUFFile(source.path), config):
        tensors[name] = tensor.to(torch.float32).to(getattr(torch, dtype)).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: transformers and vllm take it from embed_tokens
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    hf_cfg = _hf_config(config, dtype)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": hf_cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    tok = load_tokenizer(source)
    tok.backend.save(str(out / "tokenizer.json"))

    def token(token_id: int | None) -> str | None:
        return tok.id_to_token(token_id) if token_id is not None else None

    special = {
        "bos_token": token(tok.bos_token_id),
        "eos_token": token(tok.eos_token_ids[0] if tok.eos_token_ids else None),
        "unk_token": token(0),
        "pad_token": token(tok.eos_token_ids[0] if tok.eos_token_ids else None),
    }
    special = {k: v for k, v in special.items() if v is not None}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok._prepend_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": tok.chat_template,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def check(model: str | None, out: Path, prompt: str = CHECK_PROMPT, num_tokens: int = CHECK_TOKENS) -> bool:
    """Greedy-decode ``prompt`` with transformers on ``out`` and with plinth on the GGUF; True if the
    prompt ids and the first ``num_tokens`` generated ids agree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plinth import LLM, SamplingParams

    hf_tok = AutoTokenizer.from_pretrained(out)
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_ids = hf_tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = hf_model.generate(hf_ids, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None)
    hf_out = gen[0, hf_ids.shape[1] :].tolist()

    from plinth.config import EngineConfig

    # the fp32 weights exactly (no natively-multiplied quantized weights), where plinth has the option
    extra = {"quantization": "none"} if "quantization" in {f.name for f in dataclasses.fields(EngineConfig)} else {}
    llm = LLM(model=model, backend="reference", dtype="float32", **extra)
    pl_ids = llm.tokenizer.encode(prompt)
    [res] = llm.generate(pl_ids, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    pl_out = list(res.outputs[0].token_ids)

    same_prompt = hf_ids[0].tolist() == pl_ids
    same_output = hf_out == pl_out
    print(
        f"prompt ids       transformers {hf_ids[0].tolist()} plinth {pl_ids} -> {'same' if same_prompt else 'DIFFER'}"
    )
    print(f"transformers: {hf_out} {hf_tok.decode(hf_out)!r}")
    print(f"plinth:       {pl_out} {llm.tokenizer.decode(pl_out)!r}")
    print(f"first {num_tokens} greedy tokens: {'same' if same_output else 'DIFFER'}")
    return same_prompt and same_output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: plinth's default model)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="tensor dtype")
    p.add_argument("--check", action="store_true", help="compare greedy tokens of transformers and plinth")
    args = p.parse_args(argv)
    out = export(args.model, args.out, args.dtype)
    print(f"wrote {out}")
    if args.check and not check(args.model, out):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
