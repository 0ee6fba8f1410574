"""GGUF files served directly: a GGUF (or a directory holding exactly one) becomes a
small "view" directory in the gapserve cache, keyed by the file's SHA-256, holding
what both services read as text (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json with the file's chat template) and gguf_source.json, which
points the worker's weight reader at the GGUF itself (worker_svc/model/loading/gguf_tensors.py):
no weight is converted or copied.

The config and tokenizer come from transformers' own GGUF metadata readers
(`AutoConfig/AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so the served model
is the one transformers' `gguf_file=` load builds. Building the view takes about a
second and happens once per file (under a file lock, written to a temporary directory
and renamed into place, like the default model's cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from shared.model_files.gguf_header import Header, HeaderError, TensorInfo, read_header
from shared.progress import Progress
from shared.telemetry import get_logger

log = get_logger()

SOURCE_FILE = "gguf_source.json"  # marks a view directory; names the GGUF it reads
VIEW_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE)
_VIEW_VERSION = 1  # bump when the view's contents change, so old views are rebuilt

# The tensor types the exact path dequantizes (gguf.quants.dequantize, float32): the
# plain floats and the block formats Q4_K_M, Q8_0 and friends are made of. One rule,
# read by the view builder (refuses before any service starts) and the worker.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# general.architecture -> the transformers model_type our families serve; the tensor
# name tables live in worker_svc/model/loading/gguf_tensors.py under the same keys. Only the
# architectures tests check against transformers' gguf_file= load are served; a phi3
# GGUF carrying longrope factors and a qwen3moe one whose expert width transformers
# misreads are refused (transformers' GGUF load drops or misreads them).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
                 "qwen3moe": "qwen3_moe"}


class GGUFError(ValueError):
    """A GGUF file gapserve cannot serve exactly (its message names what)."""


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names (the file, or a directory holding exactly one
    *.gguf and no config.json), else None."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} GGUF files "
                            f"({', '.join(f.name for f in files)}): name one with --model")
        if files:
            return files[0].resolve()
    return None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_header(path: Path) -> Header:
    """The file's header (gguf_header.read_header: its metadata arrays stepped over,
    not parsed), or, for a file that reader does not read, GGUFReader's parse of it."""
    try:
        return read_header(path)
    except HeaderError:
        from gguf import GGUFReader, GGUFValueType
        reader = GGUFReader(str(path))
        return Header(
            {name: (f.contents() if f.types and f.types[0] != GGUFValueType.ARRAY
                    else (int(f.types[-1]), len(f.data))) for name, f in reader.fields.items()},
            tuple(TensorInfo(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
                             int(t.data_offset), int(t.n_bytes)) for t in reader.tensors))


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(ggml_type).name


def check_gguf(path: Path, header: Header | None = None) -> str:
    """Refuse, by name, an architecture no family serves or a tensor type the exact
    path does not dequantize (IQ*, TQ*, MXFP4...); return the architecture. header:
    the file's (gguf_header), if the caller has read it."""
    header = header or gguf_header(path)
    arch = header.fields.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: no general.architecture in its metadata")
    arch = str(arch)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not served (served: "
                        f"{', '.join(ARCHITECTURES)})")
    for t in header.tensors:
        if arch == "phi3" and t.name.startswith("rope_factors_"):
            raise GGUFError(f"{path}: a phi3 GGUF with longrope factors ({t.name}) is not "
                            "served: transformers' GGUF load drops longrope, so no "
                            "reference checks it; serve its Hugging Face checkpoint")
        if type_name(t.ggml_type) not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} has GGUF type {type_name(t.ggml_type)}, "
                            "which gapserve does not load (loaded: "
                            f"{', '.join(SUPPORTED_TYPES)})")
    return arch


def view_dir_for(path: Path, cache_root: Path, name: str | None = None) -> Path:
    """Keyed by the file's content; the directory's own name is the model's name, which
    the services serve it as (`--served-model-name` aside): the file's stem, or `name`."""
    return cache_root / "gguf" / file_sha256(path)[:16] / (name or path.stem)


def ensure_view(gguf_path: Path, cache_root: Path, name: str | None = None) -> Path:
    """The view directory of `gguf_path`, built on first use."""
    started = time.monotonic()
    target = view_dir_for(gguf_path, cache_root, name)
    if _is_view(target, gguf_path):
        return target
    arch = check_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another service may be building it right now
        if _is_view(target, gguf_path):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".view-") as tmp:
            out = Path(tmp) / "view"
            out.mkdir()
            _write_view(gguf_path, arch, out)
            if target.exists():  # a stale or partial view: replace it
                shutil.rmtree(target)
            os.rename(out, target)
    log.info("gguf_view_built", gguf=str(gguf_path), view=str(target), architecture=arch,
             seconds=round(time.monotonic() - started, 2))
    return target


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a view directory reads its weights from (None: not a view)."""
    src = Path(model_dir) / SOURCE_FILE
    if not src.is_file():
        return None
    return Path(json.loads(src.read_text())["path"])


def _is_view(target: Path, gguf_path: Path) -> bool:
    if not all((target / n).is_file() for n in VIEW_FILES):
        return False
    meta = json.loads((target / SOURCE_FILE).read_text())
    return meta.get("version") == _VIEW_VERSION and meta.get("path") == str(gguf_path)


def _check_expert_width(gguf_path: Path, arch: str, config) -> None:
    """transformers reads no qwen3moe.expert_feed_forward_length (it keeps its default,
    768): a file of another width is refused by name rather than loaded misread."""
    if arch != "qwen3moe":
        return
    field = gguf_header(gguf_path).fields.get("qwen3moe.expert_feed_forward_length")
    width = int(field) if field is not None else None
    if width is not None and width != config.moe_intermediate_size:
        raise GGUFError(f"{gguf_path}: qwen3moe.expert_feed_forward_length {width} is not "
                        f"what transformers' GGUF load reads ({config.moe_intermediate_size}"
                        "), so nothing checks it; serve its Hugging Face checkpoint")


def _write_view(gguf_path: Path, arch: str, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    directory, name = str(gguf_path.parent), gguf_path.name
    # the tokenizer's conversion takes most of it (about 2 minutes for a 262k vocabulary)
    with Progress(f"reading {name}'s config and tokenizer once", 2) as progress:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        if config.model_type != ARCHITECTURES[arch]:
            raise GGUFError(f"{gguf_path}: transformers reads architecture {arch!r} as "
                            f"model_type {config.model_type!r}, expected "
                            f"{ARCHITECTURES[arch]!r}")
        _check_expert_width(gguf_path, arch, config)
        progress.advance()
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        progress.advance()
    template = gguf_header(gguf_path).fields.get("tokenizer.chat_template")
    if template is not None:
        tok.chat_template = str(template)
    config.dtype = "float32"  # the exact path: dequantized to float32
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    if tok.chat_template:  # inline, where the frontend's tokenizer reads it
        tok_config["chat_template"] = tok.chat_template
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    (out / SOURCE_FILE).write_text(json.dumps(
        {"path": str(gguf_path), "architecture": arch, "version": _VIEW_VERSION},
        indent=2) + "\n")
    for p in out.iterdir():
        p.chmod(0o644)  # readable by the other services' users, like any checkout
    out.chmod(0o755)
