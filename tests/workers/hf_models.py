"""Tiny random Hugging Face models (Llama and Mistral with grouped-query attention, Qwen2 with q/k/v biases and a tied
head, GPT-2) built with ``transformers`` and saved with ``save_pretrained``; shared by the HF tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
KINDS = ("llama", "mistral", "qwen2", "gpt2")


def save_tiny(kind: str, out: Path, *, seed: int = 0) -> Path:
    """``out`` with config.json + model.safetensors of a 2-layer, 32-wide random ``kind`` model."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
            )
        )
    else:
        sizes = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        if kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**sizes))
        elif kind == "mistral":
            model = tf.MistralForCausalLM(tf.MistralConfig(**sizes))
        else:
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**sizes, tie_word_embeddings=True))
    with torch.no_grad():  # non-trivial norms and biases, so a mapping that drops them shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


def hf_logits(path: Path | str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(tokens).logits


def batch(seq_len: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(7))
