"""The daemon never turns a request's model name into a path outside its store."""
from __future__ import annotations

import pytest

from edgeinfer.server.errors import APIError
from edgeinfer.server.model_manager import ModelManager, ServerConfig
from edgeinfer.store.model_store import InvalidModelName, Store


@pytest.mark.parametrize("model", ["/etc/passwd", "../../etc/shadow.gguf", "./x.gguf",
                                   "~/model.gguf", "/tmp/gemma.gguf"])
def test_requests_cannot_name_files(edgeinfer_home, model):
    mm = ModelManager(ServerConfig(), Store(edgeinfer_home))
    with pytest.raises(APIError) as e:
        mm.resolve(model)
    assert e.value.status == 400 and "file path" in str(e.value)


def test_store_paths_only_when_allowed(edgeinfer_home, gemma3_path):
    store = Store(edgeinfer_home)
    assert store.resolve(str(gemma3_path)).path == gemma3_path.resolve()   # the CLI's --no-daemon
    with pytest.raises(InvalidModelName):
        store.resolve(str(gemma3_path), allow_path=False)


def test_copy_from_a_file_path_is_refused_for_requests(edgeinfer_home, gemma3_path):
    store = Store(edgeinfer_home)
    with pytest.raises(InvalidModelName):
        store.copy(str(gemma3_path), "stolen:1", allow_path=False)
    assert store.list() == []
