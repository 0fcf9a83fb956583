"""The CLI with images: `run FILE PROMPT --image PATH --mmproj FILE`, `pull --mmproj` storing
the projector with the model, `show` listing it, and the one-line errors."""
from __future__ import annotations

import pytest

from edgeinfer.cli.main import main

from vision_synth import noise_rgb, png_bytes, vision_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture()
def image(tmp_path):
    p = tmp_path / "photo.png"
    p.write_bytes(png_bytes(noise_rgb(30, 50)))
    return p


GREEDY = ["--temperature", "0", "--max-tokens", "3", "--no-daemon"]


def test_run_file_with_image(pair, image, capsys, edgeinfer_home):
    rc = main(["run", str(pair[0]), "what is in this picture?", "--image", str(image),
               "--image", str(image), "--mmproj", str(pair[1]), "--verbose", *GREEDY])
    out = capsys.readouterr()
    assert rc == 0, out.err
    # two images of 16 tokens each, in the prompt count
    prompt_tokens = int(out.err.split("prompt: ")[1].split(" tokens")[0])
    assert prompt_tokens > 2 * 18


def test_run_errors(pair, image, tmp_path, capsys, edgeinfer_home):
    assert main(["run", str(pair[0]), "what?", "--image", str(image), *GREEDY]) == 1
    assert "no vision projector" in capsys.readouterr().err
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["run", str(pair[0]), "what?", "--image", str(bad), "--mmproj", str(pair[1]),
                 *GREEDY]) == 1
    assert "not an image" in capsys.readouterr().err
    assert main(["run", str(pair[0]), "what?", "--image", str(image), "--raw", *GREEDY]) == 1
    assert "--raw" in capsys.readouterr().err
    assert main(["run", str(pair[0]), "what?", "--mmproj", str(pair[0]), *GREEDY]) == 1
    assert "not a vision projector" in capsys.readouterr().err


def test_pull_with_mmproj_then_show_and_run(pair, image, capsys, edgeinfer_home):
    assert main(["pull", str(pair[0]), "--name", "seer:tiny", "--mmproj", str(pair[1])]) == 0
    out = capsys.readouterr().out
    assert "vision projector for seer:tiny: gemma3 (16 tokens per image" in out
    assert main(["show", "seer:tiny"]) == 0
    assert "gemma3 projector, 16 tokens per 64x64 image" in capsys.readouterr().out
    assert main(["run", "seer:tiny", "describe", "--image", str(image), *GREEDY]) == 0
    # a projector of another width is refused, the model stays as it was
    from edgeinfer.formats.synthetic_vision import write_tiny_mmproj
    wide = write_tiny_mmproj(edgeinfer_home.parent / "wide.gguf", 512)
    assert main(["pull", str(pair[0]), "--name", "other:tiny", "--mmproj", str(wide)]) == 1
    assert "belongs to another model" in capsys.readouterr().err
    from edgeinfer.store.model_store import Store
    assert Store().resolve("other:tiny").projector_path is None
    assert main(["rm", "seer:tiny"]) == 0
    # a projector pulled as if it were a model: one line saying what to do
    assert main(["pull", str(pair[1]), "--name", "proj:tiny"]) == 1
    assert "vision projector (mmproj), not a model" in capsys.readouterr().err
