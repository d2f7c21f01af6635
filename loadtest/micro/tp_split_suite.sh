#!/usr/bin/env bash
# The DistServe experiment's tensor-parallel split on 4 GPUs in one call: Llama-3.1-70B shape (dummy bf16
# weights), every worker TP=2 on 2 GPUs: 1 prefill (GPUs 0,1) + 1 decode (GPUs 2,3) vs 2 co-located `both`
# workers (0,1 and 2,3); random ISL 2048 / OSL 128 at 1-4 req/s and ShareGPT at 2 4 8, goodput under
# TTFT <= 1500 ms / TPOT <= 100 ms (loadtest/experiments/distserve.py says why). Needs H200s: 70.5 GB of
# weights + a 40 GiB KV pool per rank (the experiment refuses smaller cards: lower --num-blocks to try).
# Everything else is distserve_suite.sh's: the carried wheels (.whl/) and .data/distserve/, NVLink
# multicast off, the same <= 7 files in $OUT (distserve.log, summary.json, results.tar.gz, 4 PNGs).
#
#   OUT=/some/dir bash loadtest/micro/tp_split_suite.sh        # OUT defaults to ./tp-split-out
#   bash loadtest/micro/tp_split_suite.sh --sharegpt-rates 2 4  # extra arguments go to the experiment
cd "$(dirname "$0")/../.." || exit 2
export OUT=${OUT:-$PWD/tp-split-out}
exec bash loadtest/micro/distserve_suite.sh --model-shape 70b --tp 2 "$@"
