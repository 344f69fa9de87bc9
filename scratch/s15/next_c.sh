# next session, call C (issue 42): LLaDA-8B dual cache with int8 / fp8 weights, then SDAR-8B batch 64 fp8 alone
# (>= 400 s; bf16 2350.7, int8 2550.5 tok/s in session 14)
exec bash scratch/s15/call4.sh
