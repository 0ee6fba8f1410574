"""Generates the Python modules in shared/proto/ from protos/: one command,
`python -m shared.proto.gen` (or scripts/gen_protos.sh); `--check` fails if the
committed modules differ from what protos/ generates now.

The protos live in package gapserve.v1, whose generated imports
(`from gapserve.v1 import ...`) would collide with our `gapserve` CLI package, so
the modules are flattened into shared/proto/ and their imports rewritten.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "gapserve" / "v1"
OUT_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Return {file name: contents} of the generated modules, imports fixed."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files in {PROTO_DIR}")
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out = {}
        for path in sorted((Path(tmp) / "gapserve" / "v1").iterdir()):
            if path.name.endswith(GENERATED_SUFFIXES):
                out[path.name] = fix_imports(path.read_text())
    return out


def fix_imports(source: str) -> str:
    return re.sub(r"^from gapserve\.v1 import ", "from shared.proto import ", source,
                  flags=re.MULTILINE)


def committed() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(OUT_DIR.iterdir())
            if p.name.endswith(GENERATED_SUFFIXES)}


def stale_files() -> list[str]:
    """Names of generated modules that are missing, extra or different."""
    want, have = generate(), committed()
    return sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed modules are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated modules (run python -m shared.proto.gen):",
                  ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    for name in committed():
        (OUT_DIR / name).unlink()
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
