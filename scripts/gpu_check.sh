#!/usr/bin/env bash
# The GPU check of issue 18 (item 9): what only a machine with NVIDIA GPUs can show. At most 8 minutes.
#
#   scripts/gpu_check.sh fetch   # here, where pip reaches PyPI: the wheels the GPU image lacks, into .whl/
#   scripts/gpu_check.sh run     # on the GPU machine, from the repository root (.whl/ carried along)
#
# The GPU image (see the device library's KINDS.md) has torch, transformers, peft, safetensors, pytest, pyyaml,
# click, pluggy, numpy, pandas, pyarrow and tqdm, but not torchdata, datasets (with dill and multiprocess) or torchao,
# and it reaches no package registry: `fetch` downloads those as wheels (add `/.whl/` to .git/info/exclude), `run`
# installs them and this checkout's automodel-core and automodel-llm into /tmp/site without touching the image.
# `run` then prints, each under its own time limit:
#   1. the GPU and the software;
#   2. a bf16 fine-tune of a ~0.5B-parameter Llama built from a config through the CLI (`automodel benchmark
#      llm`, random tokens, 2048 per sample; FSDP2 over the GPUs when there are several, torch.autocast on one):
#      tokens/s, MFU, peak memory;
#   3. the same with FP8 (torchao float8, tensorwise) where the GPU has compute capability >= 8.9;
#   4. the distributed tests of the core (tests/test_parallel_*.py: two gloo ranks on the CPU, as in CI);
#   5. bf16 FSDP2, a sharded save, the HF export and a restore on nccl, one rank per GPU (torchrun).
# It ends with one PASS/FAIL line per check and exits non-zero if any failed. Paste its output into
# docs/performance.md (section "GPU check").
set -uo pipefail

WHEELS=(torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

fetch() {
    mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
}

declare -a SUMMARY=()
FAILED=0
check() {  # check NAME SECONDS COMMAND...: a command or one of the functions below, under a time limit
    local name=$1 limit=$2 start=$SECONDS code=0
    shift 2
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" bash -c '"$@"' check "$@" || code=$?
    if [ "$code" -eq 0 ]; then
        SUMMARY+=("PASS $name ($((SECONDS - start))s)")
    else
        SUMMARY+=("FAIL $name (exit $code$([ "$code" -eq 124 ] && echo ': time limit'), $((SECONDS - start))s)")
        FAILED=1
    fi
}

install_packages() {
    local site=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl &&
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" \
            ./automodel-core ./automodel-llm
}

write_configs() {  # a 0.50e9-parameter Llama and the benchmark's YAML, under $1
    local dir=$1
    mkdir -p "$dir/llama_500m"
    cat >"$dir/llama_500m/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1536, "intermediate_size": 4096,
 "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128,
 "hidden_act": "silu", "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-05,
 "rope_theta": 500000.0, "vocab_size": 32000, "tie_word_embeddings": false, "torch_dtype": "float32"}
JSON
    cat >"$dir/bench.yaml" <<YAML
model:
  _target_: automodel_llm.AutoModelForCausalLM.from_config
  config: $dir/llama_500m/config.json
tokenizer:
  pretrained_model_name_or_path: \${pkg:automodel_llm}/examples/assets/tiny_tokenizer
step_scheduler: {max_steps: 25, grad_accumulation_steps: 1, log_interval: 5}
dataloader: {batch_size: 4}
benchmark: {warmup_steps: 5, seq_length: 2048, num_samples: 400}
optimizer: {_target_: torch.optim.AdamW, lr: 1.0e-4}
distributed:
  strategy: fsdp2
  mp_policy: {param_dtype: bfloat16, reduce_dtype: float32, output_dtype: float32}
checkpoint: {enabled: false, checkpoint_dir: $dir/ckpt}
YAML
}

benchmark() {  # benchmark NAME EXTRA_OVERRIDES...: the CLI run, its main lines, then its JSON report
    local name=$1 code=0 launch=()
    shift
    [ "$GPUS" -gt 1 ] && launch=(--nproc-per-node "$GPUS")  # FSDP2 over every GPU; one GPU: a single process
    automodel benchmark llm -c "$WORK/bench.yaml" --benchmark.output "$WORK/$name.json" "${launch[@]}" "$@" \
        >"$WORK/$name.log" 2>&1 || code=$?
    grep -E "pipeline|precision|device mesh|tokens_per_second|mfu|peak_memory|step_time" "$WORK/$name.log"
    if [ "$code" -ne 0 ]; then
        tail -n 30 "$WORK/$name.log"
        return "$code"
    fi
    python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1])), indent=1))" "$WORK/$name.json"
}

run() {
    local start=$SECONDS
    WORK=$(mktemp -d)
    export WORK
    export -f install_packages benchmark
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
    check "install (.whl and this checkout)" 90 install_packages
    check "environment" 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv &&
        python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
            \"transformers\", transformers.__version__, \"gpus\", torch.cuda.device_count(),
            \"capability\", torch.cuda.get_device_capability())"'
    write_configs "$WORK"
    GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
    export GPUS
    check "bf16 fine-tune (FSDP2 over $GPUS GPU(s) when more than one), 0.5B Llama from config" 120 benchmark bf16
    if python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 9))"; then
        check "FP8 (torchao float8 tensorwise) fine-tune, 0.5B Llama" 120 \
            benchmark fp8 --fp8.enabled true --fp8.recipe_name tensorwise
    else
        SUMMARY+=("SKIP FP8: compute capability below 8.9")
    fi
    check "distributed tests (gloo, CPU)" 120 python3 -m pytest --rootdir=. --import-mode=importlib -q -x \
        -p no:cacheprovider automodel-core/tests/test_parallel_mesh.py automodel-core/tests/test_parallel_fsdp.py \
        automodel-core/tests/test_parallel_checkpoint.py automodel-core/tests/test_parallel_memory.py
    check "nccl: bf16 FSDP2, sharded save, HF export, restore on $GPUS GPU(s)" 60 env AUTOMODEL_TEST_DEVICE=cuda \
        python3 -m torch.distributed.run --nproc-per-node "$GPUS" automodel-core/tests/parallel_workers.py smoke '{}' \
        "$WORK/smoke-{rank}.json"
    cat "$WORK"/smoke-*.json 2>/dev/null && echo
    printf '%s\n' "=== summary (${SECONDS}s in all, $((SECONDS - start))s for run)" "${SUMMARY[@]}"
    return $FAILED
}

case "${1:-}" in
    fetch) fetch ;;
    run) run ;;
    *) echo "usage: $0 fetch|run (see the comment at the top)" >&2; exit 2 ;;
esac
