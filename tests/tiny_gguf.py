"""A tiny Llama in GGUF (Q4_1 weights, a byte-level BPE tokenizer, a chat template), written
with gguf-py: the de-quantized model cache is tested on it without the 100 MB SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 single-character tokens, then the specials."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(keep, chars))]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    tokens = byte_tokens() + ["Ġt", "er", "<|im_start|>", "<|im_end|>", "<pad>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 258 + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(["Ġ t", "e r"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 2)
    w.add_pad_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>{% endif %}")

    def q4(name, rows, cols):
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    def f32(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q4("token_embd.weight", vocab if vocab % 32 == 0 else vocab, HIDDEN)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        f32(f"blk.{i}.attn_norm.weight", HIDDEN)
        q4(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        q4(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        q4(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        q4(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        f32(f"blk.{i}.ffn_norm.weight", HIDDEN)
        q4(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        q4(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        q4(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    f32("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
