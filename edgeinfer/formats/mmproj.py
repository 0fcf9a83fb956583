"""Vision projector files (llama.cpp's "mmproj" GGUFs, general.architecture "clip"): the
typed config and the checks that run before anything is loaded.

Supported projector types: "gemma3" (Gemma 3's SigLIP tower, a 2-D average pool and the
soft-embedding norm + input projection) and "idefics3" (SmolVLM: the same tower on tiles of
the image plus an overview, a pixel shuffle and one linear projection) and "mlp" (LLaVA 1.5:
a CLIP tower with a class embedding and a pre-LayerNorm, its second-to-last layer's patches,
a two-layer GELU MLP) and "pixtral" (Mistral Small 3.1 / Pixtral: any image size, 2-D RoPE,
RMSNorm + SwiGLU blocks, a patch merger, [IMG_BREAK] embeddings between rows). Every other
type is refused with one sentence.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from edgeinfer.formats.gguf_file import GGUFError, GGUFFile, read_gguf

SUPPORTED_PROJECTORS = ("gemma3", "idefics3", "mlp", "pixtral")


@dataclass(frozen=True)
class VisionConfig:
    projector: str              # clip.projector_type
    n_embd: int                 # vision width
    n_ff: int
    n_head: int
    n_layers: int
    eps: float
    image_size: int             # pixels per side after preprocessing
    patch_size: int
    n_merge: int                # gemma3: avg-pool kernel over the patch grid
    n_embd_text: int            # the text model's width the projection writes
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    name: str = ""
    # early Gemma 3 conversions stored ffn_up / ffn_down under each other's names (llama.cpp
    # swaps them back when ffn_down's rows are the width): tensor names to read
    ffn_up_name: str = "ffn_up"
    ffn_down_name: str = "ffn_down"
    # idefics3: the longest image edge after the first resize (clip.vision.preproc_image_size);
    # the image is then cut into image_size tiles, each encoded apart, plus an overview
    longest_edge: int = 0
    # the feed-forward's activation: "gelu" (tanh), or "gelu_quick" (CLIP: clip.use_gelu off)
    ffn_op: str = "gelu"
    # mlp (LLaVA): a class embedding row, a pre-LayerNorm, the layers run (all but the last),
    # the letterbox colour and resampling of libmtmd's preprocessing for it
    class_embd: bool = False
    pre_ln: bool = False
    post_ln: bool = True
    layers_run: int = 0
    pad_color: tuple[int, int, int] = (0, 0, 0)
    resample: str = "bilinear"
    # pixtral: images keep their aspect ratio (sides multiples of patch x merge) within
    # [min_tokens, max_tokens] merged patches
    dynamic: bool = False
    min_tokens: int = 0
    max_tokens: int = 0
    rope_theta: float = 10000.0

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_image(self) -> int:
        """Tokens of one encoded square (gemma3: the image; idefics3: one tile; pixtral:
        at most, for the largest image)."""
        if self.dynamic:
            return self.max_tokens
        return (self.patches_per_side // self.n_merge) ** 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def is_mmproj(gf: GGUFFile) -> bool:
    return gf.metadata.get("general.architecture") == "clip"


def _u32(md: dict, key: str, default: int | None = None) -> int:
    v = md.get(key, default)
    if v is None:
        raise GGUFError(f"the projector has no {key}")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise GGUFError(f"the projector's {key} is {v!r}, not a positive integer")
    return int(v)


def load_vision_config(gf: GGUFFile) -> VisionConfig:
    """The projector's config, after checking its keys and tensor shapes (GGUFError with one
    sentence otherwise)."""
    md = gf.metadata
    if not is_mmproj(gf):
        raise GGUFError(f"{gf.path} is not a vision projector (general.architecture is "
                        f"{md.get('general.architecture')!r}, expected 'clip')")
    if not md.get("clip.has_vision_encoder", False):
        raise GGUFError("the projector has no vision encoder (audio-only projectors are not "
                        "supported)")
    proj = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if proj not in SUPPORTED_PROJECTORS:
        raise GGUFError(f"projector type {proj!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_PROJECTORS)})")
    if proj == "pixtral":
        return _pixtral_config(gf, md)
    mean = md.get("clip.vision.image_mean")
    std = md.get("clip.vision.image_std")
    if mean is None or std is None or len(mean) < 3 or len(std) < 3:
        raise GGUFError("the projector has no clip.vision.image_mean / image_std of 3 values")
    if md.get("clip.use_silu", False):
        raise GGUFError("the projector's feed-forward is SiLU (clip.use_silu), which is not "
                        "supported")
    gelu = bool(md.get("clip.use_gelu", False))
    if not gelu and proj != "mlp":
        raise GGUFError(f"the projector's feed-forward is not GELU (clip.use_gelu), which the "
                        f"{proj} projector needs")
    if proj == "mlp" and (md.get("clip.vision.feature_layer") is not None
                          or md.get("clip.vision.image_grid_pinpoints") is not None):
        raise GGUFError("this mlp projector stacks feature layers or slices images "
                        "(LLaVA 1.6 / Granite): only LLaVA 1.5's fixed-size layout is supported")
    longest = 0
    if proj == "idefics3":
        longest = md.get("clip.vision.preproc_image_size")
        if not isinstance(longest, int) or longest <= 0:
            raise GGUFError("this idefics3 projector has no clip.vision.preproc_image_size "
                            "(an older conversion): re-convert it with a current "
                            "convert_hf_to_gguf.py")
        if md.get("clip.vision.projector.scale_factor") is None:
            raise GGUFError("the idefics3 projector has no clip.vision.projector.scale_factor")
    n_embd = _u32(md, "clip.vision.embedding_length")
    n_head = _u32(md, "clip.vision.attention.head_count")
    head_kv = md.get("clip.vision.attention.head_count_kv", n_head)
    if head_kv != n_head or n_embd % n_head:
        raise GGUFError(f"the projector's heads ({n_head}, kv {head_kv}) do not divide its "
                        f"width {n_embd} evenly")
    eps = md.get("clip.vision.attention.layer_norm_epsilon")
    if not isinstance(eps, float) or not 0 < eps < 1:
        raise GGUFError("the projector has no valid clip.vision.attention.layer_norm_epsilon")
    cfg = VisionConfig(
        projector=str(proj), n_embd=n_embd, n_ff=_u32(md, "clip.vision.feed_forward_length"),
        n_head=n_head, n_layers=_u32(md, "clip.vision.block_count"), eps=float(eps),
        image_size=_u32(md, "clip.vision.image_size"),
        patch_size=_u32(md, "clip.vision.patch_size"),
        n_merge=_u32(md, "clip.vision.projector.scale_factor", 4),
        n_embd_text=0, image_mean=tuple(float(x) for x in mean[:3]),
        image_std=tuple(float(x) for x in std[:3]), name=str(md.get("general.name", "")),
        longest_edge=int(longest), ffn_op="gelu" if gelu else "gelu_quick")
    if proj == "mlp":
        n_layers = cfg.n_layers
        cfg = replace(cfg, n_merge=1, class_embd="v.class_embd" in gf.tensors,
                 pre_ln="v.pre_ln.weight" in gf.tensors, post_ln="v.post_ln.weight" in gf.tensors,
                 layers_run=n_layers - 1, pad_color=(122, 116, 104), resample="bicubic")
    if cfg.image_size % cfg.patch_size or cfg.patches_per_side % cfg.n_merge:
        raise GGUFError(f"image size {cfg.image_size} is not a whole number of "
                        f"{cfg.patch_size}-pixel patches in groups of {cfg.n_merge}")
    if any(s == 0 for s in cfg.image_std):
        raise GGUFError("the projector's image_std has a zero")
    e, ff, p = cfg.n_embd, cfg.n_ff, cfg.patch_size
    down0 = gf.tensors.get("v.blk.0.ffn_down.weight")
    if down0 is not None and e != ff and int(down0.shape[0]) == e:
        cfg = replace(cfg, ffn_up_name="ffn_down", ffn_down_name="ffn_up")

    def need(name: str, *shape: int) -> None:
        t = gf.tensors.get(name)
        if t is None:
            raise GGUFError(f"the projector has no tensor {name}")
        got = tuple(int(d) for d in t.shape)        # ggml order
        if shape and got != shape:
            raise GGUFError(f"the projector's {name} has shape {got}, expected {shape}")
    need("v.patch_embd.weight", p, p, 3, e)
    if proj != "mlp":
        need("v.patch_embd.bias", e)
    elif "v.patch_embd.bias" in gf.tensors:
        need("v.patch_embd.bias", e)
    need("v.position_embd.weight", e, cfg.n_patches + int(cfg.class_embd))
    if cfg.class_embd:
        need("v.class_embd", e)
    if cfg.pre_ln:
        need("v.pre_ln.weight", e)
        need("v.pre_ln.bias", e)
    for i in range(cfg.n_layers):
        b = f"v.blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            need(b + n + ".weight", e, e)
            need(b + n + ".bias", e)
        for n in ("ln1", "ln2"):
            need(b + n + ".weight", e)
            need(b + n + ".bias", e)
        need(b + cfg.ffn_up_name + ".weight", e, ff)
        need(b + cfg.ffn_up_name + ".bias", ff)
        need(b + cfg.ffn_down_name + ".weight", ff, e)
        need(b + cfg.ffn_down_name + ".bias", e)
    if cfg.post_ln:
        need("v.post_ln.weight", e)
        need("v.post_ln.bias", e)
    if proj == "mlp":
        t0, t2 = gf.tensors.get("mm.0.weight"), gf.tensors.get("mm.2.weight")
        if t0 is None or t2 is None or int(t0.shape[0]) != e or len(t2.shape) != 2 \
                or int(t2.shape[0]) != int(t0.shape[1]):
            raise GGUFError(f"the projector has no mm.0.weight [{e}, hidden] and mm.2.weight "
                            "[hidden, text width]")
        need("mm.0.bias", int(t0.shape[1]))
        need("mm.2.bias", int(t2.shape[1]))
        return replace(cfg, n_embd_text=int(t2.shape[1]))
    if proj == "idefics3":
        k = e * cfg.n_merge ** 2
        t = gf.tensors.get("mm.model.fc.weight")
        if t is None or len(t.shape) != 2 or int(t.shape[0]) != k:
            raise GGUFError(f"the projector has no mm.model.fc.weight of [{k}, text width]")
        return replace(cfg, n_embd_text=int(t.shape[1]))
    need("mm.soft_emb_norm.weight", e)
    t = gf.tensors.get("mm.input_projection.weight")
    if t is None or len(t.shape) != 2 or int(t.shape[1]) != e:
        raise GGUFError("the projector has no mm.input_projection.weight of "
                        f"[text width, {e}]")
    return replace(cfg, n_embd_text=int(t.shape[0]))


def _pixtral_config(gf: GGUFFile, md: dict) -> VisionConfig:
    """Pixtral / Mistral Small 3.1: RMSNorm blocks with SwiGLU and 2-D RoPE, no learned
    positions, an optional patch merger (spatial_merge_size), mm.1 -> GELU -> mm.2 and the
    [IMG_BREAK] embedding (v.token_embd.img_break)."""
    if not md.get("clip.use_silu", False):
        raise GGUFError("the pixtral projector's feed-forward is not SiLU (clip.use_silu)")
    mean, std = md.get("clip.vision.image_mean"), md.get("clip.vision.image_std")
    if mean is None or std is None or len(mean) < 3 or len(std) < 3 or 0 in std[:3]:
        raise GGUFError("the projector has no usable clip.vision.image_mean / image_std")
    n_embd, n_head = _u32(md, "clip.vision.embedding_length"), \
        _u32(md, "clip.vision.attention.head_count")
    if n_embd % n_head or (n_embd // n_head) % 4:
        raise GGUFError(f"the projector's {n_head} heads do not split its width {n_embd} "
                        "into 2-D rotary halves")
    eps = md.get("clip.vision.attention.layer_norm_epsilon")
    if not isinstance(eps, float) or not 0 < eps < 1:
        raise GGUFError("the projector has no valid clip.vision.attention.layer_norm_epsilon")
    merge = int(md.get("clip.vision.spatial_merge_size", 1) or 1)
    cfg = VisionConfig(
        projector="pixtral", n_embd=n_embd, n_ff=_u32(md, "clip.vision.feed_forward_length"),
        n_head=n_head, n_layers=_u32(md, "clip.vision.block_count"), eps=float(eps),
        image_size=_u32(md, "clip.vision.image_size"),
        patch_size=_u32(md, "clip.vision.patch_size"), n_merge=merge, n_embd_text=0,
        image_mean=tuple(float(x) for x in mean[:3]), image_std=tuple(float(x) for x in std[:3]),
        name=str(md.get("general.name", "")), ffn_op="silu", pre_ln="v.pre_ln.weight" in gf.tensors,
        post_ln="v.post_ln.weight" in gf.tensors, resample="bicubic", dynamic=True,
        min_tokens=8, max_tokens=1024)
    e, ff, p = cfg.n_embd, cfg.n_ff, cfg.patch_size

    def need(name: str, *shape: int) -> None:
        t = gf.tensors.get(name)
        if t is None:
            raise GGUFError(f"the projector has no tensor {name}")
        got = tuple(int(d) for d in t.shape)
        if shape and got != shape:
            raise GGUFError(f"the projector's {name} has shape {got}, expected {shape}")
    need("v.patch_embd.weight", p, p, 3, e)
    if cfg.pre_ln:
        need("v.pre_ln.weight", e)
    for i in range(cfg.n_layers):
        b = f"v.blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            need(b + n + ".weight", e, e)
        need(b + "ln1.weight", e)
        need(b + "ln2.weight", e)
        need(b + "ffn_gate.weight", e, ff)
        need(b + "ffn_up.weight", e, ff)
        need(b + "ffn_down.weight", ff, e)
    if merge > 1:
        need("mm.input_norm.weight", e)
        need("mm.patch_merger.weight", e * merge * merge, e)
    t1, t2 = gf.tensors.get("mm.1.weight"), gf.tensors.get("mm.2.weight")
    if t1 is None or t2 is None or int(t1.shape[0]) != e or int(t2.shape[0]) != int(t1.shape[1]):
        raise GGUFError(f"the projector has no mm.1.weight [{e}, hidden] and mm.2.weight "
                        "[hidden, text width]")
    text = int(t2.shape[1])
    need("v.token_embd.img_break", text)
    return replace(cfg, n_embd_text=text)


def read_mmproj(path: str) -> tuple[GGUFFile, VisionConfig]:
    """Open and check a projector file; the caller closes the GGUFFile."""
    gf = read_gguf(path)
    try:
        return gf, load_vision_config(gf)
    except BaseException:
        gf.close()
        raise


def check_pair(vision: VisionConfig, n_embd_text: int, model_name: str = "the model") -> None:
    """A projector must write embeddings of its text model's width."""
    if vision.n_embd_text != n_embd_text:
        raise GGUFError(f"the projector writes {vision.n_embd_text}-wide embeddings but "
                        f"{model_name} is {n_embd_text} wide: it belongs to another model")
