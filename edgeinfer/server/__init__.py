"""The edgeinfer daemon: FastAPI app with OpenAI (/v1) and Ollama (/api) routes, the model
manager (load on demand, keep_alive, memory budget) and metrics. `create_app()` builds it;
`edgeinfer serve` runs it under uvicorn."""
from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11435          # one above Ollama's 11434, so both can run side by side
