for r in 4 256; do
python scratch/dsf.py unrolled $r
python scratch/dsf.py scan $r
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python scratch/dsf.py scan-dsf $r
done 2>&1 | grep -v Warn
