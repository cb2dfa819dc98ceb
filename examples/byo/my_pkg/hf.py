"""Hugging Face ``transformers`` models built from a small config (no download): ``gpt2(...)``, ``llama(...)``.

meshrun keeps only ``.logits`` of the model output and turns ``use_cache`` off. Word embeddings are left untied
(``tie_word_embeddings=False``): meshrun initialises every parameter by name after sharding.
"""

from __future__ import annotations

from torch import nn


def gpt2(vocab_size: int = 256, n_positions: int = 64, n_embd: int = 64, n_layer: int = 2,
         n_head: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def llama(vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
          num_attention_heads: int = 4, num_key_value_heads: int = 2, max_position_embeddings: int = 128) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                      use_cache=False, tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=0,
                      eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


# Llama's Megatron-style plan (Hugging Face's base_model_tp_plan without the head): q/k/v and gate/up split by
# output features, o/down by input features; the embedding split over the vocabulary.
LLAMA_TP_PLAN = {
    "model.embed_tokens": "vocab_parallel",
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
