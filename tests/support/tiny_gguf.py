"""The tiny Llama's folder (tiny_model.py) as a GGUF, written field by field as llama.cpp writes
one: GGUF names, Q/K rows permuted, the tokenizer's vocabulary and merges as metadata; Q8_0
blocks for the 2-D weights if `quantize`.

    gguf_path = write_tiny_gguf(tiny_folder, tmp_path / "tiny.gguf", quantize=False)
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf_writer import add_tokenizer, llamacpp_permute
from safetensors.torch import load_file


def write_tiny_gguf(folder: Path, out: Path, *, quantize: bool) -> Path:
    """The tiny HF folder as llama.cpp would write it: GGUF names, Q/K permuted, tokenizer
    vocab/merges as metadata; Q8_0 blocks for 2-D weights if `quantize`."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    add_tokenizer(writer, folder, config)

    to_gguf = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in sorted(load_file(folder / "model.safetensors").items()):
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{to_gguf[rest]}.{suffix}"
        else:
            gguf_name = f"{to_gguf[stem]}.{suffix}"
        if ".attn_q." in gguf_name:
            tensor = llamacpp_permute(tensor, heads)
        elif ".attn_k." in gguf_name:
            tensor = llamacpp_permute(tensor, kv_heads)
        array = tensor.numpy()
        if quantize and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
