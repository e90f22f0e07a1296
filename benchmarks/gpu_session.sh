#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for a lent GPU machine with no registry access.
# Usage: bash benchmarks/gpu_session.sh [STEP ...]   (steps: suite tests prepare decode decode-deepseek;
#        default: suite prepare decode; also demo families generate: the transformers integration;
#        apply batch prefill: the expert apply kernels, throughput against batch size, prefill;
#        compression decode-compressed: exponent coding (ratio, decode-copy bursts, DFloat11 beside
#        it when its wheel, dahuffman's and cupy import) and the decode step raw vs coded)
#   pytest: the test files in $TESTS (xdist workers); sm-reads: how close kernels reading pinned memory get to the copy engine (bench_sm_reads.py)
#   graphed: GraphedGenerator's tests (graphs on the GPU); quant: bench_quant.py; gemv-tiles, quant-gemv: the decode GEMVs' tiles (float, quantised)
#   suite: the README's test command, the WHOLE suite (python3 -m pytest -q); suite-parallel: the
#   same over pytest-xdist workers (its wheel and execnet's in .whl/); tests: only -m gpu
# Logs and CSVs go to $OUT (or ./gpu-out). Carried wheels in .whl/ (flashlib) are installed
# into /tmp/site first. Each step has its own time limit, so one failure doesn't stop the rest.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# install the package (editable, for the expertcache command), else import it from the tree
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  echo "editable install failed (see install.log); importing from $PWD"
fi
export EXPERTCACHE_COMMIT=${EXPERTCACHE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
steps=${*:-suite prepare decode}
for step in $steps; do
  echo "=== $step"
  case $step in
    suite) timeout ${SUITE_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --durations=12 2>&1 | tee "$OUT/suite.log" | tail -40 ;;
    graphed) timeout ${GRAPHED_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_graphed_generator.py 2>&1 | tee "$OUT/graphed_tests.log" | tail -30 ;;
    quant) timeout ${QUANT_TIMEOUT:-300} python3 benchmarks/bench_quant.py ${QUANT_ARGS:-} 2>&1 | tee "$OUT/bench_quant.log" ;;
    tests)  # the GPU-marked tests (~560 of them; over SUITE_WORKERS pytest-xdist workers: serially they take > 300 s)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu -q -n ${SUITE_WORKERS:-8} -o cache_dir=/tmp/pytest-cache \
        -o faulthandler_timeout=150 --durations=6 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    prepare) timeout 180 python3 benchmarks/bench_prepare.py --calls 100 2>&1 | tee "$OUT/bench_prepare.log" ;;
    decode) timeout 400 python3 benchmarks/bench_decode.py 2>&1 | tee "$OUT/bench_decode.log" ;;
    decode-deepseek) timeout 400 python3 benchmarks/bench_decode.py --shape deepseek-v3 2>&1 | tee "$OUT/bench_decode_deepseek.log" ;;
    demo) timeout 300 python3 -m expertcache.cli demo 2>&1 | tee "$OUT/demo.log" ;;
    families) timeout 300 python3 benchmarks/family_equivalence.py --device cuda 2>&1 | tee "$OUT/family_equivalence.log" ;;
    generate)  # GENERATE_ARGS: one or more argument sets separated by '|', one process each
      IFS='|' read -ra sets <<< "${GENERATE_ARGS:---layers 12}"
      for arguments in "${sets[@]}"; do
        echo "--- bench_generate.py $arguments" | tee -a "$OUT/bench_generate.log"
        timeout ${GENERATE_TIMEOUT:-420} python3 benchmarks/bench_generate.py $arguments 2>&1 | tee -a "$OUT/bench_generate.log"
      done ;;
    suite-parallel)  # the same suite in SUITE_WORKERS processes (pytest-xdist carried in .whl/), then
      # whatever failed once more, serially: a failure of both is a failure
      timeout ${SUITE_TIMEOUT:-560} python3 -m pytest -q -n ${SUITE_WORKERS:-14} -o cache_dir=/tmp/pytest-cache \
        -o faulthandler_timeout=${TEST_STALL_S:-150} --durations=12 2>&1 | tee "$OUT/suite.log" | tail -40
      if grep -qE "[0-9]+ (failed|error)" "$OUT/suite.log"; then
        echo "--- failed tests again, serially"
        timeout 300 python3 -m pytest -q --lf -o cache_dir=/tmp/pytest-cache -rfE 2>&1 | tee "$OUT/suite_rerun.log" | tail -30
      fi ;;
    sm-reads) timeout 240 python3 benchmarks/bench_sm_reads.py ${SM_READS_ARGS:-} 2>&1 | tee "$OUT/bench_sm_reads.log" ;;
    apply) timeout 240 python3 benchmarks/bench_apply.py 2>&1 | tee "$OUT/bench_apply.log" ;;
    gemv-tiles) timeout 240 python3 benchmarks/bench_gemv_tiles.py ${GEMV_TILES_ARGS:-} 2>&1 | tee "$OUT/bench_gemv_tiles.log" ;;
    quant-gemv) timeout ${QUANT_GEMV_TIMEOUT:-420} python3 benchmarks/bench_quant_gemv.py ${QUANT_GEMV_ARGS:-} 2>&1 \
      | tee "$OUT/bench_quant_gemv.log" ;;
    pytest)  # chosen test files ($TESTS) over SUITE_WORKERS pytest-xdist workers: a change's GPU check
      timeout ${SUITE_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -n ${SUITE_WORKERS:-8} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/pytest.log" | tail -20 ;;
    batch)  # BATCH_ARGS is read as shell words: quote what holds spaces (--only "device 25%")
      eval "timeout ${BATCH_TIMEOUT:-420} python3 benchmarks/bench_batch.py ${BATCH_ARGS:-}" 2>&1 | tee "$OUT/bench_batch.log" ;;
    prefill) timeout ${PREFILL_TIMEOUT:-300} python3 benchmarks/bench_batch.py ${PREFILL_ARGS:---prefill 1024 4096} 2>&1 | tee "$OUT/bench_prefill.log" ;;
    compression) timeout ${COMPRESSION_TIMEOUT:-240} python3 benchmarks/bench_compression.py ${COMPRESSION_ARGS:-} 2>&1 | tee "$OUT/bench_compression.log" ;;
    decode-compressed) timeout ${DECODE_COMPRESSED_TIMEOUT:-240} python3 benchmarks/bench_decode.py --compression exponent ${DECODE_COMPRESSED_ARGS:-} 2>&1 | tee "$OUT/bench_decode_compressed.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
# the CSVs travel as one archive (the device tool brings back at most 8 files)
tar -czf "$OUT/results.tgz" -C benchmarks results/ 2>/dev/null
exit 0
