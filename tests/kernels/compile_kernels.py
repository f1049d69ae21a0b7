"""Compile every Triton kernel for a Hopper GPU (sm_90) without one: Triton's own front end,
its NVIDIA passes and the ptxas it ships. Prints one JSON line per kernel and configuration.

Run as a script, outside the interpreter (TRITON_INTERPRET must be unset: under it @triton.jit
gives interpreted functions that cannot be compiled):

    python tests/kernels/compile_kernels.py
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shoal.kernels.triton.decode import _decode_merge_kernel, _decode_partial_kernel
from shoal.kernels.triton.extend import _extend_kernel
from shoal.kernels.triton.store import _store_kv_kernel

HOPPER = GPUTarget("cuda", 90, 32)


def compile_one(fn: Any, pointers: dict[str, str], constexprs: dict[str, int]) -> dict[str, Any]:
    """Everything not a pointer or constexpr is an i32 argument, except `scale` (fp32)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in ("scale", "softcap") else "i32")
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER)
    ptx = kernel.asm["ptx"]
    return {
        "kernel": fn.__name__,
        **constexprs,
        "dtype": pointers.get("Q", pointers.get("K", "")),
        "shared_bytes": kernel.metadata.shared,
        "num_warps": kernel.metadata.num_warps,
        "wgmma": "wgmma" in ptx,
        "cubin_bytes": len(kernel.asm["cubin"]),
    }


def main() -> None:
    for dtype, head_dims in (("*bf16", (64, 128)), ("*fp32", (64,))):
        for head_dim in head_dims:
            for group in (1, 3):
                cache = {"K_cache": dtype, "V_cache": dtype, "page_table": "*i64"}
                seqs = {"rows": "*i32"}
                common = {"PAGE_SIZE": 16, "GROUP": group, "HEAD_DIM": head_dim}
                common["BLOCK_D"] = head_dim
                results = [
                    compile_one(
                        _decode_partial_kernel,
                        {"Q": dtype, **cache, **seqs, "seq_lens": "*i32", "token_index": "*i32",
                         "Partial_out": "*fp32", "Partial_lse": "*fp32"},
                        {**common, "BLOCK_H": 16, "BLOCK_N": 64, "NUM_SPLITS": 16},
                    ),
                    compile_one(
                        _extend_kernel,
                        {"Q": dtype, "Out": dtype, **cache, **seqs, "prefix_lens": "*i32",
                         "extend_lens": "*i32", "extend_starts": "*i32"},
                        {**common, "BLOCK_M": 64, "BLOCK_N": 64},
                    ),
                ]  # fmt: skip
                for result in results:
                    print(json.dumps(result), flush=True)
        merge = {
            "Partial_out": "*fp32",
            "Partial_lse": "*fp32",
            "Out": dtype,
            "token_index": "*i32",
        }
        constants = {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 16, "BLOCK_S": 16}
        print(json.dumps(compile_one(_decode_merge_kernel, merge, constants)), flush=True)
        store = {"K": dtype, "V": dtype, "K_cache": dtype, "V_cache": dtype, "slot_mapping": "*i64"}
        print(json.dumps(compile_one(_store_kv_kernel, store, {"ROW": 384, "BLOCK": 512})))


if __name__ == "__main__":
    main()
