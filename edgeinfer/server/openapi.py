"""Write the OpenAPI document of the /v1 and /api routes (for fuzzers and client generators):
`python -m edgeinfer.server.openapi docs/openapi.json`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .app import create_app
from .model_manager import ServerConfig


def build() -> dict:
    doc = create_app(ServerConfig()).openapi()
    # fixed across machines and runs: no host, no dates
    return json.loads(json.dumps(doc, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = json.dumps(build(), indent=2, sort_keys=True) + "\n"
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
