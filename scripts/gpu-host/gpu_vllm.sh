#!/usr/bin/env bash
# vLLM on the registry-less GPU host, from the parts scripts/gpu-host/host_wheels.sh --vllm wrote here.
#
# The host receives at most 64 MiB per command, and keeps /tmp between commands while it is held (about
# 30 s between them). So each command carries one part: the device tool's carry [".whl/vllm/part-NN",
# ".whl/vllm/SHA256SUMS"], and runs
#
#     bash scripts/gpu-host/gpu_vllm.sh [COMMAND ...]
#
# which checks the part it received against SHA256SUMS and keeps it in /tmp/vllm-parts. Once every part
# is there it joins them, checks the whole tar, and installs its wheels (vLLM 0.25.1 and the packages the
# host lacks, the bus's among them) into /tmp/site, once. Then, with the environment vLLM needs there
# (PYTHONPATH, VLLM_USE_FLASHINFER_SAMPLER=0 and VLLM_ATTENTION_BACKEND=FLASH_ATTN: the host has no
# flashinfer), it runs COMMAND, if given; before that it only says which parts are still missing.
# Exit status: COMMAND's, 0 when waiting for parts, 1 on a bad part or a failed install.
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
DIR=${VLLM_PARTS_DIR:-.whl/vllm}  # where the carried part and SHA256SUMS are
SUMS=$DIR/SHA256SUMS
PARTS=/tmp/vllm-parts
SITE=/tmp/site
[ -f "$SUMS" ] || { echo "no $SUMS: carry it with each part (scripts/gpu-host/host_wheels.sh --vllm makes both)" >&2; exit 1; }
mkdir -p "$PARTS" "$SITE/bin"
for part in "$DIR"/part-*; do
    [ -e "$part" ] || continue
    name=$(basename "$part")
    want=$(awk -v n="$name" '$2 == n {print $1}' "$SUMS")
    got=$(sha256sum "$part" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
        echo "$name: checksum ${got:0:12} is not the one SHA256SUMS lists (${want:0:12}): carry it again" >&2
        exit 1
    fi
    cp "$part" "$PARTS/$name" && echo "$name received and checked"
done
stamp=$SITE/.vllm-wheels-$(awk '$2 == "vllm-wheels.tar" {print substr($1, 1, 16)}' "$SUMS")
if [ ! -f "$stamp" ]; then
    missing=$(awk '$2 ~ /^part-/ {print $2}' "$SUMS" | while read -r n; do [ -f "$PARTS/$n" ] || echo "$n"; done)
    if [ -n "$missing" ]; then
        echo "waiting for: $(echo $missing)"
        exit 0
    fi
    cat "$PARTS"/part-* > /tmp/vllm-wheels.tar
    want=$(awk '$2 == "vllm-wheels.tar" {print $1}' "$SUMS")
    [ "$(sha256sum /tmp/vllm-wheels.tar | cut -d' ' -f1)" = "$want" ] || { echo "joined tar: bad checksum" >&2; exit 1; }
    rm -rf /tmp/vllm-wheels && mkdir -p /tmp/vllm-wheels && tar -C /tmp/vllm-wheels -xf /tmp/vllm-wheels.tar
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        /tmp/vllm-wheels/wheels/*.whl || { echo "pip install failed" >&2; exit 1; }
    rm -f /tmp/vllm-wheels.tar
    touch "$stamp"
    echo "installed $(ls /tmp/vllm-wheels/wheels | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ATTENTION_BACKEND=FLASH_ATTN
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > "$SITE/bin/areal-bus"
chmod +x "$SITE/bin/areal-bus"
[ $# -gt 0 ] || { python3 -c "import vllm; print('vllm', vllm.__version__, 'ready')"; exit $?; }
"$@"
