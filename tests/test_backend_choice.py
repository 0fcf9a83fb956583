"""--backend / --device (and EDGEINFER_BACKEND / EDGEINFER_DEVICE): names, combinations,
command-line validation, and one clear line for a device this machine lacks."""
from __future__ import annotations

import pytest

from edgeinfer.runners.choice import (BackendChoiceError, check, device_missing, resolve,
                                      with_defaults)
from edgeinfer.cli.main import main

HAS_CUDA = device_missing("cuda") is None
HAS_MPS = device_missing("mps") is None


@pytest.mark.parametrize("backend,device", [
    ("auto", None), ("cpu", None), ("llamacpp", None), ("torch", None), ("torch:cpu", None),
    ("torch", "cuda"), ("torch", "cpu"), ("auto", "mps"), ("torch:cuda", "cuda"),
])
def test_valid_names(backend, device):
    check(backend, device)


@pytest.mark.parametrize("backend,device,field,words", [
    ("abacus", None, "backend", "unknown backend"),
    ("torch:tpu", None, "backend", "unknown backend"),
    ("cpu:cuda", None, "backend", "unknown backend"),
    ("torch", "gpu", "device", "unknown device"),
    ("cpu", "cuda", "device", "does not apply to the cpu backend"),
    ("llamacpp", "cpu", "device", "does not apply to the llamacpp backend"),
    ("torch:cpu", "cuda", "device", "disagree"),
])
def test_invalid_names(backend, device, field, words):
    with pytest.raises(BackendChoiceError, match=words) as e:
        check(backend, device)
    assert e.value.field == field


def test_resolve_combines_backend_and_device():
    assert resolve("torch", "cpu", "gemma3") == "torch:cpu"
    assert resolve("torch:cpu", None, "gemma3") == "torch:cpu"
    assert resolve("auto", "cpu", "gemma3") == "cpu"            # the native numba backend
    assert resolve("auto", "cpu", "phi2") == "llamacpp"         # no native model: llama.cpp
    assert resolve("auto", None, "phi2") == "llamacpp"
    assert resolve("cpu", None, "gemma3") == "cpu"
    assert resolve("llamacpp", None, "gemma3") == "llamacpp"
    best = "torch:cuda" if HAS_CUDA else "torch:mps" if HAS_MPS else "torch:cpu"
    assert resolve("torch", None, "gemma3") == best
    with pytest.raises(BackendChoiceError, match="no native model") as e:
        resolve("auto", "cuda", "phi2")
    assert e.value.field == "device"


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_missing_cuda_is_one_sentence():
    for backend, device, field in (("auto", "cuda", "device"), ("torch", "cuda", "device"),
                                   ("torch:cuda", None, "backend")):
        with pytest.raises(BackendChoiceError, match="'cuda' is not available") as e:
            resolve(backend, device, "gemma3")
        assert e.value.field == field and "\n" not in str(e.value)


def test_with_defaults():
    # nothing asked: the defaults
    assert with_defaults(None, None, "cpu", None) == ("cpu", None)
    # a device alone: auto places the model there, unless the default backend is torch
    assert with_defaults(None, "cuda", "cpu", None) == ("auto", "cuda")
    assert with_defaults(None, "cpu", "llamacpp", None) == ("auto", "cpu")
    assert with_defaults(None, "cuda", "torch", "cpu") == ("torch", "cuda")
    assert with_defaults(None, "cuda", "torch:cpu", None) == ("auto", "cuda")
    # a backend alone takes the default device only when it accepts one
    assert with_defaults("torch", None, "cpu", "cuda") == ("torch", "cuda")
    assert with_defaults("cpu", None, "auto", "cuda") == ("cpu", None)
    assert with_defaults("torch:cpu", None, "auto", "cuda") == ("torch:cpu", None)


# ----- the command line --------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["run", "m", "--backend", "cpu", "--device", "cuda"], "does not apply to the cpu backend"),
    (["run", "m", "--backend", "llamacpp", "--device", "cpu"], "does not apply to the llamacpp"),
    (["run", "m", "--backend", "torch:cpu", "--device", "mps"], "disagree"),
    (["run", "m", "--device", "gpu"], "invalid choice"),
    (["serve", "--backend", "cpu", "--device", "cuda"], "does not apply to the cpu backend"),
    (["serve", "--backend", "abacus"], "unknown backend"),
    (["daemon", "start", "--backend", "llamacpp", "--device", "cpu"], "does not apply"),
])
def test_cli_usage_errors_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_cli_parses_device(monkeypatch):
    from edgeinfer.cli.main import build_parser
    a = build_parser().parse_args(["run", "m", "--backend", "torch", "--device", "cpu"])
    assert (a.backend, a.device) == ("torch", "cpu")
    a = build_parser().parse_args(["serve", "--device", "mps"])
    assert (a.backend, a.device) == (None, "mps")
    a = build_parser().parse_args(["run", "m"])
    assert (a.backend, a.device) == ("auto", None)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("argv", [
    ["run", "MODEL", "hi", "--device", "cuda", "--no-daemon"],
    ["run", "MODEL", "hi", "--backend", "torch", "--device", "cuda", "--no-daemon"],
    ["run", "MODEL", "hi", "--backend", "torch:cuda", "--no-daemon"],
])
def test_cli_missing_device_is_one_line(argv, gemma3_path, capsys):
    argv = [str(gemma3_path) if a == "MODEL" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: ") and "'cuda' is not available" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_serve_refuses_a_missing_device(monkeypatch, capsys):
    monkeypatch.setenv("EDGEINFER_DEVICE", "cuda")
    assert main(["serve", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert "'cuda' is not available" in err and err.count("\n") == 1


def test_server_config_from_env_and_flags(monkeypatch):
    from edgeinfer.server.model_manager import ServerConfig
    for k in ("EDGEINFER_BACKEND", "EDGEINFER_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    c = ServerConfig.from_env()
    assert (c.backend, c.device) == ("cpu", None)
    c = ServerConfig.from_env(device="cpu")
    assert (c.backend, c.device) == ("auto", "cpu")
    monkeypatch.setenv("EDGEINFER_BACKEND", "torch")
    monkeypatch.setenv("EDGEINFER_DEVICE", "cpu")
    c = ServerConfig.from_env()
    assert (c.backend, c.device) == ("torch", "cpu")
    c = ServerConfig.from_env(backend="llamacpp")       # the flag wins; cpu was a default
    assert (c.backend, c.device) == ("llamacpp", None)
    monkeypatch.setenv("EDGEINFER_BACKEND", "llamacpp")
    with pytest.raises(BackendChoiceError, match="does not apply"):
        ServerConfig.from_env()


# ----- show and ps: backend and weights format ---------------------------------------------

def _summary(arch: str = "gemma3"):
    from types import SimpleNamespace
    return SimpleNamespace(arch=arch, path=None)


def test_show_rows_for_a_loaded_model():
    from edgeinfer.cli.show import placement_rows
    rows = dict(placement_rows(_summary(), [
        {"backend": "torch:cpu", "device": "cpu", "weights_format": "float32"}]))
    assert rows["backend"] == "torch:cpu (loaded in the daemon)"
    assert rows["weights"] == "float32: dequantized once at load to dense float32 on the cpu device"
    rows = placement_rows(_summary(), [
        {"backend": "cpu", "weights_format": "gguf (quantized)"},
        {"backend": "llamacpp", "weights_format": "gguf (llama.cpp)"}])
    assert [v for k, v in rows if k == "weights"] == [
        "gguf (quantized): GGUF quantized blocks, dequantized per matmul",
        "gguf (llama.cpp): GGUF tensors held by llama.cpp"]


def test_show_rows_predict_auto_when_not_loaded(monkeypatch):
    from edgeinfer.runners.choice import resolve
    from edgeinfer.cli.show import placement_rows
    rows = dict(placement_rows(_summary(), []))
    picked = resolve("auto", None, "gemma3")
    assert rows["backend"] == f"{picked} (not loaded; what --backend auto picks on this machine)"
    if picked == "cpu":
        assert rows["weights"] == "gguf (quantized): GGUF quantized blocks, dequantized per matmul"
    rows = dict(placement_rows(_summary("phi2"), []))
    assert rows["backend"].startswith("llamacpp (not loaded")
    assert rows["weights"] == "gguf (llama.cpp): GGUF tensors held by llama.cpp"


def test_torch_weights_format_prediction():
    from edgeinfer.runners.choice import describe_weights, weights_format_of
    assert weights_format_of("torch:cpu") == "float32"       # exact parity with numba on CPU
    assert weights_format_of("torch:cpu", torch_dtype="bfloat16") == "bfloat16"
    assert describe_weights("torch:cpu", torch_dtype="bfloat16") == \
        "bfloat16: dequantized once at load to dense bfloat16 on the cpu device"
    # a CPU runner that describes its own layout is shown in its own words
    assert describe_weights("cpu", "int8 tiles repacked") == "int8 tiles repacked"


def test_cpu_weights_prediction_follows_the_runner(gemma3_path):
    """What `show` predicts for the numba backend is what CpuOps decides for the file."""
    from edgeinfer.runners.choice import weights_format_of
    assert "int8" not in weights_format_of("cpu", str(gemma3_path), repack=False)
    assert "int8" in weights_format_of("cpu", str(gemma3_path), repack=True)


def test_cli_show_without_daemon(gemma3_path, capsys):
    """The tests' EDGEINFER_HOST answers nothing: show predicts auto's choice."""
    from edgeinfer.runners.choice import resolve, weights_format_of
    assert main(["show", str(gemma3_path)]) == 0
    out = capsys.readouterr().out
    picked = resolve("auto", None, "gemma3")
    assert f"backend           {picked} (not loaded" in out
    assert f"weights           {weights_format_of(picked, str(gemma3_path))}" in out


def test_format_ps_backend_and_weights_columns():
    from edgeinfer.cli.manage import format_ps
    out = format_ps([
        {"name": "gemma3:270m", "digest": "a" * 64, "size": 300_000_000, "backend": "cpu",
         "device": "cpu", "weights_format": "gguf (quantized)", "context_length": 8192,
         "expires_at": "2262-04-11T23:47:16Z", "kv_cache_type": "q8_0",
         "kv_bytes_per_token": 9792},
        {"name": "gemma3:270m", "digest": "a" * 64, "size": 900_000_000,
         "backend": "torch:cuda", "device": "cuda", "weights_format": "bfloat16",
         "context_length": 8192, "active_requests": 1},
        {"name": "phi3:mini", "digest": "b" * 64, "size": 2_000_000_000, "backend": "llamacpp",
         "device": "cpu", "weights_format": "gguf (llama.cpp)", "context_length": 4096}])
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "PROCESSOR", "BACKEND", "WEIGHTS",
                                "KV", "CACHE", "CONTEXT", "UNTIL"]
    cols = [[c.strip() for c in line.split("    ") if c.strip()] for line in lines[1:]]
    assert cols[0][3:8] == ["100% CPU", "cpu", "gguf (quantized)", "q8_0 9,792 B/tok", "8192"]
    assert cols[1][3:] == ["100% GPU", "torch:cuda", "bfloat16", "-", "8192", "busy"]
    assert cols[2][3:6] == ["100% CPU", "llamacpp", "gguf (llama.cpp)"]
