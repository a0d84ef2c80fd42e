#!/usr/bin/env bash
# Which configs Inductor picks for the compiled kernels' reductions, and what the picks cost, in one
# device call. Each run compiles from its own empty Inductor cache:
#   target-a, target-b   the 8B target forward (bench/target_forward.py), the reduction configs timed by
#                        Inductor (--reduction-configs timed) and picked from the kernel's shape (heuristic)
#   target-c, target-d   the same two, compiled while another process keeps the GPU busy with matmuls (as
#                        a job's other rank may), then timed from that cache with the GPU to themselves
#   drafter-a, drafter-b the 8B drafter step, timed and heuristic
# (Call I2 ran it before the benches had --reduction-configs, with TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS
# 0 and 1, the same flag.)
# From the repo root:  bash bench/run_picks_h200.sh   (under $OUT: run_picks.log, picks.json, each run's JSON)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # bench_env, step
bench_env
LOG=$OUT/run_picks.log
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, torch._inductor.config as c; print('torch', torch.__version__, 'deterministic:', hasattr(c, 'deterministic'), 'force_filter_reduction_configs:', hasattr(c.test_configs, 'force_filter_reduction_configs'))" | tee -a "$LOG"
hog() {  # keep the GPU busy with bf16 matmuls until /tmp/hog_on is removed
    touch /tmp/hog_on
    python3 -c "
import os, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
while os.path.exists('/tmp/hog_on'):
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
" &
}
unhog() { rm -f /tmp/hog_on; wait; }
target() {  # NAME CHOICE: one target bench process on cache /tmp/ind_NAME
    step "target-$1" 150 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 OUT=/tmp/out_$1 python3 target_forward.py \
        --steps 10 --variants trunc-triton-compiled-graph --reduction-configs $2
    cp /tmp/out_$1/target_qwen3_8b.json "$OUT/picks_target_$1.json"
}
cd bench
target a timed
target b heuristic
hog; target c timed; unhog
mv "$OUT/picks_target_c.json" "$OUT/picks_target_c_compiled.json"; target c timed
hog; target d heuristic; unhog
mv "$OUT/picks_target_d.json" "$OUT/picks_target_d_compiled.json"; target d heuristic
for run in a:timed b:heuristic; do
    name=${run%:*}
    step "drafter-$name" 200 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind_drafter_$name OUT=/tmp/out_drafter_$name \
        python3 drafter_step.py --preset qwen3_8b --modes default+ce=triton --scope layers --steps 10 --warmup 3 \
        --reduction-configs ${run#*:}
    cp /tmp/out_drafter_$name/drafter_qwen3_8b_layers.json "$OUT/picks_drafter_$name.json"
done
cd ..
python3 - "$OUT" <<'EOF' | tee -a "$LOG"
import glob, json, os, re, sys
out = sys.argv[1]
def picks(cache):
    """kernel name -> the config Inductor kept for it (its .best_config beside the kernel's source; a
    directory holding several sources is skipped)."""
    found = {}
    for path in glob.glob(os.path.join(cache, "**", "*.best_config"), recursive=True):
        sources = glob.glob(os.path.join(os.path.dirname(path), "*.py"))  # the kernel's, named by another hash
        if len(sources) != 1:
            continue
        try:
            found[re.search(r"def (triton_\w+)\(", open(sources[0]).read()).group(1)] = json.load(open(path))
        except (OSError, AttributeError, ValueError):
            continue
    return found
def kernels(prof, keys):
    return [(k["name"][:100], k["ms"]) for k in prof.get("top_kernels", []) if any(s in k["name"] for s in keys)]
summary = {}
rows = []
for name in ("target_a", "target_b", "target_c", "target_d", "drafter_a", "drafter_b"):
    try:
        d = json.load(open(os.path.join(out, f"picks_{name}.json")))
    except (OSError, ValueError):
        continue
    runs = d.get("variants") or d.get("modes") or []
    r = runs[0] if runs else {}
    prof = r.get("profile") or {}
    cache = "/tmp/ind_" + (name.split("_")[1] if name.startswith("target") else name)
    keep = {k: v for k, v in picks(cache).items() if k.startswith(("triton_per", "triton_red"))}
    summary[name] = {"ms": r.get("ms") or r.get("ms_per_step"), "classes": prof.get("ms_per_step_by_class"),
                     "qk_kernels": kernels(prof, ("doc_attention_mean", "cat_mean_mul_neg_pow_rsqrt_split")),
                     "picks": keep}
    qk = sum(ms for _, ms in summary[name]["qk_kernels"])
    rows.append((name, summary[name]["ms"], (prof.get("ms_per_step_by_class") or {}).get("fused_triton"), qk))
with open(os.path.join(out, "picks.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"\n{'run':10} | {'ms':>8} | {'fused Triton ms':>15} | {'q/k norm+RoPE kernels ms':>24}")
for n, ms, fused, qk in rows:
    print(f"{n:10} | {ms or 0:8.2f} | {fused or 0:15.2f} | {qk:24.3f}")
for n, s in summary.items():
    for k, v in s["picks"].items():
        if "rsqrt" in k and ("doc_attention" in k or "split" in k):
            print(n, k[:70], {x: v.get(x) for x in ("XBLOCK", "R0_BLOCK", "num_warps", "num_stages")})
EOF
echo "== done at $((SECONDS - t0)) s" | tee -a "$LOG"
