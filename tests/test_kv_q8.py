"""The q8_0 KV cache: ggml's block_q8_0 bytes in the CPU pool, read back exactly, attention
over it equal to attention over the same values in float32, and batch invariance."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numba import njit

from edgeinfer.backends.cpu import attention as A
from edgeinfer.backends.cpu import kernels as K
from edgeinfer.backends.cpu.ops import CpuOps
from edgeinfer.settings import KV_BYTES_PER_VALUE


def q8_reference(x: np.ndarray) -> bytes:
    """ggml's quantize_row_q8_0 (x86 form) in numpy: per 32 values d = amax/127 stored in
    f16, codes round-half-even(x * 127/amax)."""
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(np.abs(blk).max())
        d = np.float16(amax / np.float32(127.0))
        idv = np.float32(127.0) / amax if amax else np.float32(0.0)
        codes = np.rint(blk * idv).astype(np.int8)
        out += d.tobytes() + codes.tobytes()
    return bytes(out)


def q8_pool(num_blocks, bs, kvh, d):
    return np.zeros((num_blocks, bs, kvh, K.kv_row_width("q8_0", d)), np.uint8)


@njit(cache=False)
def _read_scalar(cache, out):
    for b in range(cache.shape[0]):
        for o in range(cache.shape[1]):
            for h in range(cache.shape[2]):
                for d in range(out.shape[3]):
                    out[b, o, h, d] = K.kv_scalar(cache, (b, o, h, d))
    return out


def _random_kv(rng, T, kvh, d):
    k = (rng.standard_normal((T, kvh, d)) * rng.uniform(0.01, 30, (T, kvh, 1))).astype(np.float32)
    k[0, 0, :32] = 0.0                       # an all-zero block: d = 0, codes 0
    v = rng.standard_normal((T, kvh, d)).astype(np.float32)
    return k, v


def test_kv_write_stores_ggml_q8_0_blocks():
    rng = np.random.default_rng(0)
    T, kvh, d, bs = 24, 2, 64, 4
    k, v = _random_kv(rng, T, kvh, d)
    kc, vc = q8_pool(8, bs, kvh, d), q8_pool(8, bs, kvh, d)
    slots = rng.permutation(8 * bs)[:T].astype(np.int64)
    K.kv_write(kc, vc, k, v, slots)
    for t in range(T):
        blk, off = divmod(int(slots[t]), bs)
        for h in range(kvh):
            assert kc[blk, off, h].tobytes() == q8_reference(k[t, h])
            assert vc[blk, off, h].tobytes() == q8_reference(v[t, h])
    # gguf's own Q8_0 decoder reads our bytes as the values they stand for, and kv_scalar
    # reads the same values
    flat = dequantize(kc.reshape(-1), GGMLQuantizationType.Q8_0).reshape(8, bs, kvh, d)
    got = _read_scalar(kc, np.empty((8, bs, kvh, d), np.float32))
    np.testing.assert_array_equal(got, flat)
    # and they are within half a step of the inputs (plus the f16 rounding of the step)
    for t in range(T):
        blk, off = divmod(int(slots[t]), bs)
        step = np.abs(k[t]).reshape(kvh, -1, 32).max(-1, keepdims=True) / 127
        err = np.abs(flat[blk, off] - k[t]).reshape(kvh, -1, 32)
        assert (err <= step * (0.5 + 127 / 2048) + 1e-30).all()


def test_gguf_quantizer_agrees_on_codes():
    """gguf's reference quantizer (1/d, not 127/amax) gives the same bytes nearly always."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 1, 256)).astype(np.float32)
    kc = q8_pool(64, 1, 1, 256)
    K.kv_write(kc, kc.copy(), x, x, np.arange(64, dtype=np.int64))
    from gguf.quants import quantize
    ref = quantize(x.reshape(64, 256), GGMLQuantizationType.Q8_0).reshape(-1)
    same = (kc.reshape(-1) == ref).mean()
    assert same > 0.999, same


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("rounding", [True, False])
def test_attention_over_q8_pool_equals_f32_pool_of_its_values(window, rounding):
    """kv_vec widens codes * d exactly: attention over the q8_0 pool is the same bits as over
    an f32 pool holding the dequantized values, mixed prefill and decode, grouped heads."""
    rng = np.random.default_rng(2)
    H, kvh, d, bs, nblk = 4, 2, 64, 4, 12
    kc, vc = q8_pool(nblk, bs, kvh, d), q8_pool(nblk, bs, kvh, d)
    lens = [13, 9]
    tables = np.array([[3, 7, 1, 10], [0, 5, 11, 2]], np.int32)
    seq = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lens)])
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    slots = (tables[seq, pos // bs].astype(np.int64) * bs + pos % bs)
    k, v = _random_kv(rng, len(seq), kvh, d)
    K.kv_write(kc, vc, k, v, slots)
    kf = dequantize(kc.reshape(-1), GGMLQuantizationType.Q8_0).reshape(nblk, bs, kvh, d)
    vf = dequantize(vc.reshape(-1), GGMLQuantizationType.Q8_0).reshape(nblk, bs, kvh, d)
    kf, vf = np.ascontiguousarray(kf, np.float32), np.ascontiguousarray(vf, np.float32)
    q = rng.standard_normal((len(seq), H, d)).astype(np.float32)
    for nh in (1, 2):
        a = A.paged_attention(q, kc, vc, tables, seq, pos, window, np.float32(0.125), rounding,
                              np.empty_like(q), False, nh)
        b = A.paged_attention(q, kf, vf, tables, seq, pos, window, np.float32(0.125), rounding,
                              np.empty_like(q), False, nh)
        np.testing.assert_array_equal(a, b)
        # a token alone (decode) gives the same bits as inside the batch
        alone = A.paged_attention(q[20:21], kc, vc, tables, seq[20:21], pos[20:21], window,
                                  np.float32(0.125), rounding, np.empty_like(q[:1]), False, nh)
        np.testing.assert_array_equal(alone[0], a[20])


def test_cpu_ops_kv_types():
    ops = CpuOps(kv_cache_type="q8_0")
    assert ops.kv_bytes_per_value == KV_BYTES_PER_VALUE["q8_0"] == 34 / 32
    cache = ops.new_kv_cache(2, 3, 16, 1, 256)
    assert cache.k[0].dtype == np.uint8 and cache.k[0].shape == (3, 16, 1, 8 * 34)
    assert cache.nbytes == 2 * 2 * 3 * 16 * 8 * 34
    assert CpuOps().kv_bytes_per_value == 2 and CpuOps().kv_cache_type == "f16"
    assert CpuOps(numerics="f32").kv_cache_type == "f32"
    with pytest.raises(ValueError, match="f16 or q8_0"):
        CpuOps(kv_cache_type="q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.new_kv_cache(1, 1, 16, 1, 48)


# ----- settings, CLI, model manager ----------------------------------------------------------

def test_settings_kv_cache_type(monkeypatch):
    from edgeinfer.settings import Settings, SettingsError
    assert Settings.from_env({}).kv_cache_type == "f16"
    assert Settings.from_env({"EDGEINFER_KV_CACHE_TYPE": "Q8_0"}).kv_cache_type == "q8_0"
    with pytest.raises(SettingsError, match="EDGEINFER_KV_CACHE_TYPE 'q4_0'.*f16 or q8_0"):
        Settings.from_env({"EDGEINFER_KV_CACHE_TYPE": "q4_0"})
    s = Settings.from_env({}, kv_cache_type="q8_0")
    from edgeinfer.engine.core import EngineConfig
    assert EngineConfig.from_settings(s, "cpu").kv_cache_type == "q8_0"
    assert EngineConfig.from_settings(s, "cpu", kv_cache_type="f16").kv_cache_type == "f16"


@pytest.mark.parametrize("argv", [["run", "m", "--kv-cache-type", "q4_0"],
                                  ["serve", "--kv-cache-type", "f32"]])
def test_cli_rejects_unknown_kv_cache_type(argv, capsys):
    from edgeinfer.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-type" in err and "'f16'" in err and "'q8_0'" in err


def test_cli_parses_kv_cache_type():
    from edgeinfer.cli.main import build_parser
    assert build_parser().parse_args(["run", "m", "--kv-cache-type", "q8_0"]).kv_cache_type == "q8_0"
    assert build_parser().parse_args(["serve", "--kv-cache-type", "q8_0"]).kv_cache_type == "q8_0"
    assert build_parser().parse_args(["run", "m"]).kv_cache_type is None


def test_server_config_takes_the_flag(monkeypatch):
    from edgeinfer.server.model_manager import ServerConfig
    monkeypatch.setenv("EDGEINFER_KV_CACHE_TYPE", "q8_0")
    assert ServerConfig.from_env().kv_cache_type == "q8_0"
    assert ServerConfig.from_env(kv_cache_type="f16").kv_cache_type == "f16"


def test_torch_refuses_q8_0():
    torch_ops = pytest.importorskip("edgeinfer.backends.torch.ops")
    with pytest.raises(ValueError, match="torch backend.*q8_0"):
        torch_ops.TorchOps(device="cpu", check_memory=False, kv_cache_type="q8_0")


def test_estimate_and_show_use_the_true_bytes(gemma3_path):
    from edgeinfer.cli.show import kv_row, load_summary
    from edgeinfer.runners.choice import estimate_memory
    for backend in ("cpu", "llamacpp"):
        est = estimate_memory(backend, str(gemma3_path), kv_cache_type="q8_0")
        assert (est.kv_cache_type, est.kv_bytes_per_value) == ("q8_0", 34 / 32)
        assert est.kv_bytes_per_token(18, 1, 256) == 9792
        assert estimate_memory(backend, str(gemma3_path), kv_cache_type="f16"
                               ).kv_bytes_per_token(18, 1, 256) == 18432
    s = load_summary(str(gemma3_path))
    _, text = kv_row(s, "cpu", "q8_0")
    assert text.startswith("9,792 bytes/token (q8_0 on cpu)")
    _, text = kv_row(s, "cpu", "f16")
    assert text.startswith("18,432 bytes/token (f16 on cpu)")


class _FakeEngine:
    """What the manager reads of a loaded engine: its EngineInfo figures, close(), dead."""

    def __init__(self, path, ecfg):
        from types import SimpleNamespace
        self.ecfg = ecfg
        self.info = SimpleNamespace(
            weights_bytes=1000, kv_bytes=2000, weights_format="fake", kv_window=0,
            kv_bytes_per_token=9792 if ecfg.kv_cache_type == "q8_0" else 18432)
        self.max_model_len = 64
        self.dead = None
        self.closed = False

    def close(self):
        self.closed = True


def test_manager_reloads_an_idle_model_for_another_kv_type(monkeypatch, tmp_path, gemma3_path):
    """A request's kv_cache_type load option: an idle copy with another type is reloaded,
    a busy one refuses with a 400 naming the option; no option keeps what is loaded."""
    import asyncio

    from edgeinfer.runners.choice import MemoryEstimate
    from edgeinfer.server import model_manager as mm
    from edgeinfer.server.errors import APIError
    from edgeinfer.store.model_store import Store
    engines = []

    def new_engine(path, ecfg, mmproj, remote, status):
        engines.append(_FakeEngine(path, ecfg))
        return engines[-1]
    monkeypatch.setattr(mm, "_load_engine", new_engine)
    monkeypatch.setattr(mm, "estimate_memory", lambda *a, **k: MemoryEstimate(1000, 2))
    monkeypatch.setattr(mm, "release_memory", lambda: None)
    store = Store(tmp_path)
    store.register_file(gemma3_path, "gemma3:270m")
    cfg = mm.ServerConfig.from_env(backend="cpu", kv_cache_type="f16", engine_process=False)

    async def go():
        m = mm.ModelManager(cfg, store)
        lm, _ = await m.acquire("gemma3:270m")
        assert (lm.kv_cache_type, lm.kv_bytes_per_token) == ("f16", 18432)
        m.release(lm)
        lm, _ = await m.acquire("gemma3:270m", kv_cache_type="q8_0")      # idle: reload
        assert (lm.kv_cache_type, lm.kv_bytes_per_token) == ("q8_0", 9792)
        assert len(engines) == 2 and engines[0].closed
        assert engines[1].ecfg.kv_cache_type == "q8_0"
        with pytest.raises(APIError) as e:                               # busy: refused
            await m.acquire("gemma3:270m", kv_cache_type="f16")
        assert e.value.status == 400 and e.value.param == "kv_cache_type"
        assert "q8_0" in str(e.value) and "retry" in str(e.value)
        lm2, _ = await m.acquire("gemma3:270m")             # no option: the loaded copy
        assert lm2 is lm and len(engines) == 2
        with pytest.raises(APIError) as e:
            await m.acquire("gemma3:270m", kv_cache_type="q4_0")
        assert e.value.status == 400 and "f16 or q8_0" in str(e.value)
        with pytest.raises(APIError) as e:
            await m.acquire("gemma3:270m", backend="torch:cpu", kv_cache_type="q8_0")
        assert e.value.status == 400
        m.release(lm, 2)
    asyncio.run(go())


def test_hadamard_rotation_is_llamacpps_and_its_own_inverse():
    """_rotate: each 64-value chunk times Sylvester's H_64 / 8 (H_2n = [[H, H], [H, -H]], the
    matrix llama.cpp builds), the same bits for a row alone or in a batch, and rotating twice
    gives the input back."""
    from edgeinfer.backends.cpu import _rotate as R
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4, 256)).astype(np.float32)
    y = R.rotate(x, False)
    H = np.ones((1, 1))
    while H.shape[0] < 64:
        H = np.block([[H, H], [H, -H]])
    H = H / 8.0
    want = (x.astype(np.float64).reshape(-1, 64) @ H.T).reshape(x.shape)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(R.rotate(x[2:3], False)[0], y[2])
    np.testing.assert_array_equal(R.rotate(x, True), y)
    np.testing.assert_allclose(R.rotate(y, False), x, rtol=0, atol=1e-5)


def test_apis_reject_an_unknown_kv_cache_type(tmp_path, monkeypatch):
    """Both APIs: a bad kv_cache_type load option is a 400 naming the field and the types,
    before anything is loaded."""
    from fastapi.testclient import TestClient

    from edgeinfer.server.app import create_app
    from edgeinfer.server.model_manager import ModelManager, ServerConfig
    from edgeinfer.store.model_store import Store
    cfg = ServerConfig.from_env(backend="cpu")
    app = create_app(cfg, manager=ModelManager(cfg, Store(tmp_path)))
    with TestClient(app) as c:
        r = c.post("/api/generate", json={"model": "gemma3:270m", "prompt": "hi",
                                          "options": {"kv_cache_type": "q4_0"}})
        assert r.status_code == 400
        assert "kv_cache_type" in r.text and "'f16'" in r.text and "'q8_0'" in r.text
        r = c.post("/v1/chat/completions", json={
            "model": "gemma3:270m", "messages": [{"role": "user", "content": "hi"}],
            "kv_cache_type": "f32"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_cache_type" and "'q8_0'" in r.text
