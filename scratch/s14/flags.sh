# backend compile seconds of one test file under XLA:CPU flag variants
F=${F:-tests/test_generate_sdar.py}
for extra in "" "--xla_cpu_use_fusion_emitters=false" "--xla_cpu_parallel_codegen_split_count=1" "--xla_cpu_emitter_verification_level=0" "--xla_cpu_enable_concurrency_optimized_scheduler=false" "--xla_cpu_use_xnnpack=false" "--xla_cpu_disable_loop_unrolling=true"; do
  rm -f /tmp/compile_probe.txt
  start=$(date +%s.%N)
  r=$(PYTHONPATH=scratch/s14 XLA_FLAGS="--xla_backend_optimization_level=0 $extra" TEST_XLA_FLAGS="--xla_backend_optimization_level=0 $extra" .venv/bin/python -m pytest -m "not gpu" -q -p compile_probe -p no:cacheprovider $F 2>&1 | tail -1)
  end=$(date +%s.%N)
  echo "[$extra] wall=$(echo "$end - $start" | bc) $r :: $(cut -c1-200 /tmp/compile_probe.txt | tr '\n' ' ')"
done
