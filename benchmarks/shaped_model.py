"""A model file of a real model's shape and llama.cpp's quantization recipe, random weights:
for speed measurements where the real file is not at hand offline (never for quality).

    .venv/bin/python benchmarks/shaped_model.py --preset qwen2.5-1.5b [--ftype Q4_K_M] \
        [--out .cache/shaped/qwen2.5-1.5b-q4_k_m.gguf]
    ... --ftype F16 --like FILE    (no llama.cpp needed: a GPU machine's torch benchmark)

The vocabulary, template and every other metadata key come from a real file of the same
family (--like; default the bundled Qwen2.5-Coder 0.5B Instruct), the shape from the preset
(the model's config.json), so the tokenizer, the output head's width and each matrix's size
are the real model's. The tensors are written in F16 (normal, std 0.02; norms 1, biases 0),
then quantized by llama.cpp's own quantizer with --ftype, which picks each tensor's type as it
would for the real model (Q4_K_M: Q4_K, with Q6_K for half of ffn_down and attn_v and for the
tied output head). Speed does not depend on the weights' values; generated text is noise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

# config.json of Qwen/Qwen2.5-1.5B-Instruct (and Qwen2.5-Coder-1.5B-Instruct): tied embeddings
PRESETS = {
    "qwen2.5-0.5b": dict(arch="qwen2", layers=24, hidden=896, ffn=4864, heads=14, kv_heads=2,
                         tied=True, size_label="0.5B"),
    "qwen2.5-1.5b": dict(arch="qwen2", layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2,
                         tied=True, size_label="1.5B"),
}


def write_f16(out: Path, like: str, p: dict) -> Path:
    import gguf

    from edgeinfer.formats.gguf_file import read_gguf
    src = read_gguf(like)
    arch = p["arch"]
    assert src.metadata["general.architecture"] == arch, "--like must be of the same family"
    w = gguf.GGUFWriter(str(out), arch)
    _copy_metadata(w, src.metadata, skip=("general.file_type", "general.quantization_version"),
                   replace={f"{arch}.block_count": p["layers"],
                            f"{arch}.embedding_length": p["hidden"],
                            f"{arch}.feed_forward_length": p["ffn"],
                            f"{arch}.attention.head_count": p["heads"],
                            f"{arch}.attention.head_count_kv": p["kv_heads"],
                            "general.name": f"shaped {p['size_label']} (random weights)",
                            "general.size_label": p["size_label"]})
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = len(src.metadata["tokenizer.ggml.tokens"])
    src.close()
    rng = np.random.default_rng(0)
    h, f, hd = p["hidden"], p["ffn"], p["hidden"] // p["heads"]
    kv = p["kv_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:     # numpy shape (rows, cols): ggml (cols, rows)
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(vocab, h))
    if not p["tied"]:
        w.add_tensor("output.weight", mat(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(p["layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(b + "attn_q.weight", mat(h, h))
        w.add_tensor(b + "attn_k.weight", mat(kv, h))
        w.add_tensor(b + "attn_v.weight", mat(kv, h))
        w.add_tensor(b + "attn_output.weight", mat(h, h))
        for n, size in (("attn_q.bias", h), ("attn_k.bias", kv), ("attn_v.bias", kv)):
            w.add_tensor(b + n, np.zeros(size, np.float32))
        w.add_tensor(b + "ffn_gate.weight", mat(f, h))
        w.add_tensor(b + "ffn_up.weight", mat(f, h))
        w.add_tensor(b + "ffn_down.weight", mat(h, f))
    _finish(w)
    return out


def write_metadata(out: Path, like: str) -> Path:
    """`like`'s metadata with no tensors: the vocabulary and template a shaped model takes,
    a few MB where the model is hundreds (what travels to a GPU machine)."""
    import gguf

    from edgeinfer.formats.gguf_file import read_gguf
    src = read_gguf(like)
    w = gguf.GGUFWriter(str(out), src.metadata["general.architecture"])
    _copy_metadata(w, src.metadata)
    src.close()
    _finish(w)
    return out


def _copy_metadata(w, metadata: dict, skip: tuple = (), replace: dict | None = None) -> None:
    """metadata's keys into the writer (but the architecture, which it was made with, and
    `skip`), each value replaced by `replace`'s where it has one."""
    replace = replace or {}
    for k, v in metadata.items():
        if k != "general.architecture" and k not in skip:
            _add(w, k, replace.get(k, v))


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w, key: str, v) -> None:
    import gguf
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v) if 0 <= v < 1 << 32 else w.add_int64(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, np.ndarray):
        w.add_array(key, v.tolist())
    elif isinstance(v, list):
        w.add_array(key, v)
    else:
        raise TypeError(f"{key}: {type(v).__name__}")
    del gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-1.5b")
    ap.add_argument("--like", default=None, help="a real GGUF of the family (default: the "
                    "store's qwen2.5-coder:0.5b)")
    ap.add_argument("--ftype", default="Q4_K_M")
    ap.add_argument("--out", default=None)
    ap.add_argument("--metadata-only", metavar="OUT", default=None,
                    help="write only --like's metadata (no tensors) to OUT: a small --like")
    a = ap.parse_args()
    if a.like is None:
        from edgeinfer.store.model_store import Store
        a.like = str(Store().resolve("qwen2.5-coder:0.5b").path)
    if a.metadata_only:
        print(write_metadata(Path(a.metadata_only), a.like))
        return
    out = Path(a.out or REPO / ".cache" / "shaped" / f"{a.preset}-{a.ftype.lower()}.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.ftype.upper() == "F16":
        print(write_f16(out, a.like, PRESETS[a.preset]))
        return
    from synth import quantize
    f16 = out.with_suffix(".f16.gguf")
    write_f16(f16, a.like, PRESETS[a.preset])
    quantize(f16, out.with_suffix(".tmp"), a.ftype).rename(out)
    f16.unlink()
    print(out)


if __name__ == "__main__":
    main()
