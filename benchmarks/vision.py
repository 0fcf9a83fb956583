"""Image in, first token out: the native engine vs llama.cpp (libmtmd) on the same synthetic
Gemma 3 text model + mmproj, same process, same threads, interleaved rounds.

    .venv/bin/python benchmarks/vision.py [--image-size 448] [--width 768] [--layers 12]
        [--ff 3072] [--heads 12] [--patch 14] [--merge 4] [--rounds 3] [--f16]

Per round each side gets a fresh image (no encoder cache, no prefix cache) and a short chat
prompt around it, and we time:
- encode: preprocessing + vision tower + projector (ours: VisionEncoder.encode; llama.cpp:
  mtmd_encode_chunk on the image chunk);
- image + prefill: the whole prompt to its first token (ours: encode + engine prefill of
  text and image spans, sampling one token; llama.cpp: mtmd_helper_eval_chunks, which encodes
  and decodes every chunk, logits of the last position).
The defaults are a mid-size SigLIP (86M parameters, 1024 patches -> 64 image tokens); Gemma 3
4B's real tower is --image-size 896 --width 1152 --layers 27 --ff 4304 --heads 16 (minutes per
image on 2 cores). Medians of the rounds, and ours / llama.cpp time ratios (< 1: we are faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ff", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--merge", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--f16", action="store_true", help="f16 matrices (as released mmproj files)")
    args = ap.parse_args()

    import numba
    numba.set_num_threads(args.threads)
    from edgeinfer.engine.core import Engine, EngineConfig, greedy
    from edgeinfer.engine.images import MEDIA_MARKER
    from edgeinfer.formats.image import decode_image
    from edgeinfer.formats.synthetic_vision import (TinyVisionShape, write_gemma3_vision_text,
                                                    write_tiny_mmproj)
    from mtmd_oracle import MtmdOracle
    from vision_synth import noise_rgb, png_bytes

    tmp = Path(tempfile.mkdtemp(prefix="edgeinfer-vision-bench-"))
    text = write_gemma3_vision_text(tmp / "text.gguf")
    shape = TinyVisionShape(n_embd=args.width, n_ff=args.ff, n_head=args.heads,
                            layers=args.layers, image_size=args.image_size,
                            patch_size=args.patch, n_merge=args.merge)
    mmproj = write_tiny_mmproj(tmp / "mmproj.gguf", 256, shape, f16=args.f16)
    n_params = args.layers * (4 * args.width ** 2 + 2 * args.width * args.ff)
    patches = (args.image_size // args.patch) ** 2
    tokens = patches // args.merge ** 2
    print(f"tower: {n_params / 1e6:.0f}M matrix parameters ({'f16' if args.f16 else 'f32'}), "
          f"{args.image_size}px -> {patches} patches -> {tokens} image tokens; "
          f"{args.threads} threads")

    engine = Engine(str(text), EngineConfig(kv_budget_bytes=64 << 20), mmproj=str(mmproj))
    oracle = MtmdOracle(str(text), str(mmproj), n_ctx=max(512, tokens + 128),
                        n_batch=max(512, tokens + 64))
    prompt_text = f"Look at this picture: {MEDIA_MARKER} What is in it?"
    msgs = [{"role": "user", "content": prompt_text}]
    rows = {k: {"ours": [], "llama.cpp": []} for k in ("encode", "image + prefill")}
    try:
        for r in range(args.rounds + 1):                  # round 0 warms both up
            order = ("ours", "llama.cpp") if r % 2 else ("llama.cpp", "ours")
            for side in order:
                img = decode_image(png_bytes(noise_rgb(args.image_size, args.image_size,
                                                       seed=1000 * r + (side == "ours"))))
                if side == "ours":
                    t0 = time.perf_counter()
                    engine.vision.encode(img)
                    enc = time.perf_counter() - t0
                    img2 = decode_image(png_bytes(noise_rgb(args.image_size, args.image_size,
                                                            seed=7000 + r)))
                    t0 = time.perf_counter()
                    ids, spans = engine.encode_chat_images(msgs, [img2])
                    engine.generate(ids, greedy(1), images=spans)
                    total = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    oracle.embeddings(img.rgb)
                    enc = time.perf_counter() - t0
                    img2 = noise_rgb(args.image_size, args.image_size, seed=9000 + r)
                    rendered = engine.render(msgs)
                    t0 = time.perf_counter()
                    oracle.next_logits(rendered, [img2])
                    total = time.perf_counter() - t0
                if r:
                    rows["encode"][side].append(enc)
                    rows["image + prefill"][side].append(total)
    finally:
        oracle.close()
        engine.close()
    print(f"\n| {'':16} | {'ours (s)':>16} | {'llama.cpp (s)':>16} | {'ours / llama.cpp':>16} |")
    print(f"|{'-' * 18}|{'-' * 18}|{'-' * 18}|{'-' * 18}|")
    for k, v in rows.items():
        a, b = statistics.median(v["ours"]), statistics.median(v["llama.cpp"])
        ra = f"{a:.3f} ({min(v['ours']):.3f}-{max(v['ours']):.3f})"
        rb = f"{b:.3f} ({min(v['llama.cpp']):.3f}-{max(v['llama.cpp']):.3f})"
        print(f"| {k:16} | {ra:>16} | {rb:>16} | {a / b:>16.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
