"""The benches' where-the-time-goes profile sorts CUDA kernels into classes by name
(bench/common.kernel_class). The names here are the H200 profiler's, from the 8B drafter step and
target forward (bench/results/*.json): Inductor names a fused kernel after the ops in it, so a name can
hold words of several classes, and the first rule that fits must be the right one."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import kernel_class  # noqa: E402

NAMES = {
    # AdamW's update, compiled (optim.adamw_update): its name holds "copy_" and "_to_copy" too.
    "triton_poi_fused__to_copy_add_copy_copy__div_gt_lerp_mul_pow_rsub_sqrt_sub_where_5": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous n": "optimizer",
    # RMSNorm with the residual add, and its backward: dtype casts, not copies.
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused_triton",
    "triton_per_fused__to_copy_add_div_expand_mul_pow_sum_6": "fused_triton",
    "triton_per_fused__to_copy__unsafe_view_add_cat_doc_attention_mean_mul_neg_pow_rsqrt_sel": "fused_triton",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Unknown)": "copy",
    "memcpy128": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::(anonymous n": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tens": "copy",
    # Inductor's GEMM templates (max-autotune), alone or with a norm and the SwiGLU fused around them.
    "triton_tem_fused_mm_t_view_2": "matmul",
    "triton_tem_fused__to_copy__unsafe_view_add_mean_mm_mul_pow_rsqrt_silu_t_view_5": "matmul",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    # flex_attention's templates, one with a bmm in its prologue.
    "triton_tem_fused_flex_attention_0": "flex_attention",
    "triton_tem_fused_flex_attention_backward_select_backward_transpose_view_3": "flex_attention",
    "triton_tem_fused__to_copy__unsafe_view_add_bmm_cat_cos_flex_attention_mean_mul_pow_rs": "flex_attention",
    "block_attn_bwd_dkv": "block_attention",
    "doc_attn_fwd": "doc_attention",
    "grad_kernel": "loss",
    "stats_lanes_kernel": "loss",
    "triton_poi_fused_mul_silu_silu_backward_0": "fused_triton",
    "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t": "reduce",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 1, false>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_each_profiled_kernel_gets_its_class(name):
    assert kernel_class(name) == NAMES[name]
